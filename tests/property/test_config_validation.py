"""Random configurations either validate or raise ValueError naming the field, nothing else."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bagualu2.costmodel import Hardware, ModelConfig, ParallelConfig, build_graph, presets

small = st.one_of(st.integers(-2, 40), st.just(0), st.booleans(), st.floats(-1, 3), st.none())


@given(num_layers=small, hidden=small, heads=small, groups=small, head_dim=small, ffn=small, moe_ffn=small,
       experts=small, top_k=small, shared=small, dense=small, vocab=small, seq=small, mbs=small,
       dtype=st.sampled_from(["bf16", "fp16", "fp32", "int8", 3]), flash=st.sampled_from([True, False, 1]),
       act=st.sampled_from(["swiglu", "gelu", "relu"]), dropout=st.sampled_from([0.0, 0.1, 1.0, -0.1, "x"]))
def test_model_config_validates_or_raises_value_error(num_layers, hidden, heads, groups, head_dim, ffn, moe_ffn,
                                                      experts, top_k, shared, dense, vocab, seq, mbs, dtype,
                                                      flash, act, dropout):
    try:
        ModelConfig(num_layers=num_layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
                    head_dim=head_dim, ffn_hidden_size=ffn, moe_ffn_hidden_size=moe_ffn, num_experts=experts,
                    top_k=top_k, num_shared_experts=shared, num_dense_layers=dense, vocab_size=vocab,
                    seq_length=seq, micro_batch_size=mbs, dtype=dtype, flash_attention=flash, activation=act,
                    hidden_dropout=dropout)
    except ValueError as exc:
        assert "\n" not in str(exc) and len(str(exc)) > 10


@given(dp=small, tp=small, ep=small, pp=small, vp=small, cp=small, m=small,
       sp=st.sampled_from([True, False, "yes"]), imbalance=st.one_of(st.floats(-1, 4), st.integers(0, 3)),
       model_name=st.sampled_from(["tiny-dense", "tiny-moe", "glm-188b-a20b"]))
def test_parallel_layout_validates_or_raises_value_error(dp, tp, ep, pp, vp, cp, m, sp, imbalance, model_name):
    model, _ = presets.model(model_name)
    try:
        parallel = ParallelConfig(dp=dp, tp=tp, ep=ep, pp=pp, vp=vp, cp=cp, num_microbatches=m,
                                  sequence_parallel=sp)
        graph = build_graph(model, parallel, presets.hardware("cpu"), imbalance=imbalance)
    except ValueError as exc:
        assert "\n" not in str(exc)
        return
    assert graph.unmitigated_bytes >= graph.floor_bytes > 0


def _moe(**changes):
    base = dict(num_layers=8, hidden_size=64, num_attention_heads=8, num_query_groups=4, head_dim=8,
                ffn_hidden_size=256, moe_ffn_hidden_size=32, num_experts=8, top_k=2, vocab_size=100,
                seq_length=32)
    base.update(changes)
    return ModelConfig(**base)


@pytest.mark.parametrize("model_changes, parallel, field", [
    ({}, ParallelConfig(dp=6, ep=3), "num_experts"),
    ({}, ParallelConfig(tp=3, dp=1), "num_attention_heads"),
    ({}, ParallelConfig(pp=3), "num_layers"),
    ({}, ParallelConfig(pp=2, vp=3, num_microbatches=2), "num_layers"),
])
def test_incompatible_layouts_name_the_field(model_changes, parallel, field):
    with pytest.raises(ValueError, match=field):
        build_graph(_moe(**model_changes), parallel, presets.hardware("cpu"))


@pytest.mark.parametrize("changes, field", [
    ({"top_k": 9}, "top_k"), ({"hidden_size": 0}, "hidden_size"), ({"seq_length": -4}, "seq_length"),
    ({"num_query_groups": 3}, "num_query_groups"), ({"dtype": "int4"}, "dtype"),
    ({"num_experts": 0}, "num_experts=0"),
])
def test_invalid_model_fields(changes, field):
    with pytest.raises(ValueError, match=field):
        _moe(**changes)


def test_imbalance_below_one_and_unknown_presets():
    with pytest.raises(ValueError, match="imbalance"):
        build_graph(_moe(), ParallelConfig(), presets.hardware("cpu"), imbalance=0.9)
    with pytest.raises(ValueError, match="valid: .*glm-1041b-a35b-12k"):
        presets.model("glm-9000b")
    with pytest.raises(ValueError, match="valid: paper-gpu"):
        presets.hardware("tpu")


def test_hardware_json_round_trip_and_errors():
    hw = presets.hardware("h100")
    assert Hardware.from_json(hw.to_json()) == hw
    with pytest.raises(ValueError, match="unknown hardware field"):
        Hardware.from_json('{"name": "x", "flops": 1}')
    with pytest.raises(ValueError, match="peak_flops"):
        Hardware.from_json(hw.to_json().replace('"peak_flops": 989000000000000.0', '"peak_flops": -1'))


def test_attention_efficiency_defaults_to_the_matmul_efficiency_and_is_checked():
    hw = presets.hardware("paper-gpu")
    assert hw.attention_share == hw.attention_efficiency == 0.40
    plain = dataclasses.replace(hw, attention_efficiency=None)
    assert plain.attention_share == plain.matmul_efficiency
    assert Hardware.from_json(plain.to_json()) == plain
    for bad in (0.0, 1.5, float("nan"), "fast", True):
        with pytest.raises(ValueError, match=r"^attention_efficiency must be null or a finite number in \[0.01, 1\]"):
            dataclasses.replace(hw, attention_efficiency=bad)
