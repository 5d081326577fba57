"""The trainer's metrics (reference_trainer/metrics.py): FLOPs against a hand count and the simulator, MFU, the
JSONL writer (rank 0 only, strict JSON, resume truncation, atomic rewrite, path checks), the quiet progress bar,
the summary table."""

from __future__ import annotations

import json
import math
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from bagualu2.costmodel import ModelConfig, Plan, Strategy, build_graph, evaluate, presets
from bagualu2.costmodel.graph import MATMUL_KINDS
from bagualu2.sim.stage import StageContext
from reference_trainer.metrics import (MICROBATCH_FIELDS, STEP_FIELDS, SUMMARY_FIELDS, MetricsWriter, Progress,
                                       human_bytes, jsonable, layer_flops_per_token, mfu, model_flops_per_token,
                                       plan_recompute_flops_per_token, print_summary, recompute_flops_per_token,
                                       summary_table, truncate_for_resume)

# h=8, a=2, g=1, d=4, s=10, f=16, fe=6, E=4, K=2, S=1, V=32; layer 0 dense, layers 1-2 MoE
TINY = ModelConfig(num_layers=3, hidden_size=8, num_attention_heads=2, num_query_groups=1, head_dim=4,
                   ffn_hidden_size=16, moe_ffn_hidden_size=6, num_experts=4, top_k=2, num_shared_experts=1,
                   num_dense_layers=1, vocab_size=32, seq_length=10, micro_batch_size=2)
HW = presets.hardware("cpu")


# ---- FLOPs -------------------------------------------------------------------------------------------------
def hand_count(activation: str = "swiglu", moe: bool = True) -> tuple[int, int]:
    """(layer forward FLOPs per token, output layer forward FLOPs per token) of TINY, by hand."""
    w = 2 if activation == "swiglu" else 1
    attention = 2 * 8 * (2 + 2 * 1) * 4 + 2 * 10 * 2 * 4 + 2 * 2 * 4 * 8  # qkv + causal QK^T/PV + out proj
    assert attention == 256 + 160 + 128
    dense = 2 * 8 * 16 * w + 2 * 16 * 8
    expert = 2 * 8 * 6 * w + 2 * 6 * 8
    moe_layer = 2 * 8 * 4 + 2 * expert + 1 * expert  # router + top-2 routed + 1 shared
    layers = 3 * attention + (dense + 2 * moe_layer if moe else 3 * dense)
    return layers, 2 * 8 * 32


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
def test_model_flops_match_a_hand_count_moe(activation):
    layers, output = hand_count(activation)
    config = TINY.replace(activation=activation)
    if activation == "swiglu":
        assert layers == 4256  # 3*544 + 768 + 2*928
    assert layer_flops_per_token(config) == 3 * layers
    assert model_flops_per_token(config) == 3 * (layers + output)
    assert model_flops_per_token(config.replace(tie_embeddings=True)) == 3 * (layers + output)


def test_model_flops_match_a_hand_count_dense():
    dense = TINY.replace(moe_ffn_hidden_size=0, num_experts=0, top_k=0, num_shared_experts=0, num_dense_layers=0)
    layers, output = hand_count(moe=False)
    assert model_flops_per_token(dense) == 3 * (layers + output) == 3 * (3 * 544 + 3 * 768 + 512)
    # more routed experts at the same top-k cost only the router
    wide = TINY.replace(num_experts=8)
    assert model_flops_per_token(wide) - model_flops_per_token(TINY) == 3 * 2 * (2 * 8 * 4)


@pytest.mark.parametrize("layout", [{}, {"vp": 2}, {"tp": 2, "sequence_parallel": True}])
def test_layer_flops_equal_the_simulators_model_flops(layout):
    """simulate(): flops per GPU = mean over stages of StageContext.model_flops; x pp*tp GPUs of one replica."""
    model, parallel = presets.model("tiny-moe")
    parallel = parallel.replace(**layout)
    stages = [StageContext(model, parallel, HW, stage) for stage in range(parallel.pp)]
    per_gpu = sum(ctx.model_flops() for ctx in stages) / parallel.pp  # simulate.py's `run.flops`
    tokens = parallel.num_microbatches * model.seq_length * model.micro_batch_size
    assert per_gpu * parallel.pp * parallel.tp == pytest.approx(layer_flops_per_token(model) * tokens, rel=1e-12)


def test_recompute_flops():
    assert recompute_flops_per_token(TINY, 0.0) == 0.0
    assert recompute_flops_per_token(TINY, 1.0) == hand_count()[0]  # one more forward of the layers
    assert recompute_flops_per_token(TINY, 0.5) == hand_count()[0] / 2
    with pytest.raises(ValueError, match="recompute_fraction"):
        recompute_flops_per_token(TINY, 1.5)
    assert plan_recompute_flops_per_token([100, 50.0], tokens=30) == 5.0
    with pytest.raises(ValueError, match="tokens"):
        plan_recompute_flops_per_token([1], tokens=0)
    # the cost model's PlanCost.recompute_flops of the plans a step ran: at most a full recompute
    model, parallel = presets.model("tiny-moe")
    plan = Plan.uniform({kind: Strategy.RECOMPUTE for kind in MATMUL_KINDS})
    per_mb = [evaluate(build_graph(model, parallel, HW, stage=s), plan).recompute_flops for s in range(parallel.pp)]
    assert all(f > 0 for f in per_mb)
    tokens = parallel.num_microbatches * model.seq_length * model.micro_batch_size
    measured = plan_recompute_flops_per_token(per_mb * parallel.num_microbatches, tokens=tokens)
    assert 0 < measured <= recompute_flops_per_token(model, 1.0)


def test_mfu():
    assert mfu(4e12, 2.0, peak_flops=1e12, num_devices=4) == 0.5
    assert mfu(0, 1.0, peak_flops=1e12, num_devices=1) == 0.0
    for bad in ({"seconds": 0.0}, {"seconds": math.nan}, {"peak_flops": 0.0}, {"num_devices": 0}):
        kwargs = {"seconds": 1.0, "peak_flops": 1e12, "num_devices": 1, **bad}
        with pytest.raises(ValueError, match=next(iter(bad))):
            mfu(1.0, kwargs.pop("seconds"), **kwargs)


# ---- the JSONL writer --------------------------------------------------------------------------------------
def read(path) -> list[dict]:
    return [json.loads(line) for line in open(path, encoding="utf-8")]


def step(i: int, **extra) -> dict:
    return {"step": i, "loss": 1.0 / (i + 1), **extra}


def test_rank_nonzero_and_no_path_write_nothing(tmp_path):
    path = tmp_path / "m.jsonl"
    for writer in (MetricsWriter(path, rank=1), MetricsWriter(None, rank=0),
                   MetricsWriter(tmp_path / "missing" / "m.jsonl", rank=3, resume_step=2)):  # not even checked
        writer.write(step(0))
        writer.close()
    assert list(tmp_path.iterdir()) == []


def test_lines_are_strict_json_with_nan_as_null(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path, rank=0) as writer:
        writer.write(step(0, mfu=math.nan, hfu=math.inf, microbatches=[{"imbalance": (1.5, -math.inf)}]))
        writer.write({"summary": True, "steps": 1, "tokens_per_s": 12.5})
        assert len(path.read_text().splitlines()) == 2  # flushed at once
    lines = path.read_text().splitlines()
    assert all("NaN" not in line and "Infinity" not in line for line in lines)
    first, summary = read(path)
    assert first["mfu"] is None and first["hfu"] is None and first["microbatches"][0]["imbalance"] == [1.5, None]
    assert summary == {"summary": True, "steps": 1, "tokens_per_s": 12.5}
    with pytest.raises(TypeError):
        MetricsWriter(tmp_path / "x.jsonl", rank=0).write({"bad": object()})
    with pytest.raises(ValueError, match="closed"):
        writer.write(step(1))
    other = MetricsWriter(path, rank=1)
    other.close()
    other.write(step(1))  # other ranks: a no-op even after close


def test_jsonable_unwraps_scalars():
    class Scalar:
        def __init__(self, value):
            self.value = value

        def item(self):
            return self.value

    assert jsonable({"a": Scalar(math.nan), "b": (Scalar(3), True)}) == {"a": None, "b": [3, True]}


def test_fresh_run_truncates_and_resume_keeps_earlier_steps(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsWriter(path, rank=0) as writer:
        for i in range(5):
            writer.write(step(i))
        writer.write({"summary": True, "steps": 5})
    path.write_text(path.read_text() + '{"step": 5, "lo')  # a line cut short by a crash
    with MetricsWriter(path, rank=0, resume_step=3) as writer:
        assert [r["step"] for r in read(path)] == [0, 1, 2]
        writer.write(step(3))
    assert [r["step"] for r in read(path)] == [0, 1, 2, 3]
    assert sorted(os.listdir(tmp_path)) == ["m.jsonl"]  # no temp file left
    MetricsWriter(path, rank=0).close()
    assert path.read_text() == ""
    MetricsWriter(tmp_path / "new.jsonl", rank=0, resume_step=7).close()  # resume without a log: a new one
    assert (tmp_path / "new.jsonl").read_text() == ""


def test_resume_keeps_the_file_mode_and_leaves_no_temp_file_on_failure(tmp_path, monkeypatch):
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(step(i)) + "\n" for i in range(3)))
    os.chmod(path, 0o640)
    truncate_for_resume(str(path), 1)
    assert os.stat(path).st_mode & 0o777 == 0o640 and [r["step"] for r in read(path)] == [0]

    def fail(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        truncate_for_resume(str(path), 0)
    assert sorted(os.listdir(tmp_path)) == ["m.jsonl"] and [r["step"] for r in read(path)] == [0]


def test_refuses_a_directory_and_a_missing_directory(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path}.*not a regular file") as error:
        MetricsWriter(tmp_path, rank=0)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="missing.*does not exist"):
        MetricsWriter(tmp_path / "missing" / "m.jsonl", rank=0)
    with pytest.raises(ValueError, match="resume_step"):
        MetricsWriter(tmp_path / "m.jsonl", rank=0, resume_step=-1)


records = st.lists(st.one_of(
    st.builds(lambda i, loss: {"step": i, "loss": loss}, st.integers(0, 20), st.floats(allow_nan=True)),
    st.builds(lambda i: {"summary": True, "steps": i, "step": i}, st.integers(0, 20)),
    st.just({"note": "no step"}), st.just({"step": 2.0}), st.just({"step": True})), max_size=30)


@given(records, st.integers(0, 25))
def test_resume_truncation_property(tmp_path_factory, rows, resume_step):
    path = tmp_path_factory.mktemp("log") / "m.jsonl"
    with MetricsWriter(path, rank=0) as writer:
        for row in rows:
            writer.write(row)
    MetricsWriter(path, rank=0, resume_step=resume_step).close()
    expected = [jsonable(r) for r in rows
                if "summary" not in r and type(r.get("step")) is int and r["step"] < resume_step]
    assert read(path) == expected
    assert os.listdir(path.parent) == ["m.jsonl"]


# ---- terminal ----------------------------------------------------------------------------------------------
def test_progress_is_silent_without_a_tty(capsys):
    for rank in (0, 1):
        bar = Progress(10, rank=rank, start_step=2)
        for i in range(2, 10):
            bar.update(i, loss=math.nan, tokens_per_s=1e3)
        bar.close()
    assert capsys.readouterr() == ("", "")


def test_progress_draws_on_a_console():
    console = Console(record=True, width=120, force_terminal=False)
    bar = Progress(4, rank=0, start_step=1, console=console)
    bar.update(3, loss=0.1234, tokens_per_s=2500)
    bar.close()
    text = console.export_text()
    assert "4/4" in text and "0.1234" in text and "2,500" in text
    with pytest.raises(ValueError, match="start_step"):
        Progress(4, rank=0, start_step=5)


SUMMARY = {"summary": True, "steps": 20, "final_loss": 0.5, "oom_events": 1, "restarts": 1, "restart_s": 12.34,
           "tokens_per_s": 12345.6, "mfu": 0.4123, "hfu": 0.5, "peak_activation_bytes": 3 * 2 ** 30,
           "planning_fraction": 0.0123}


def render(table) -> str:
    console = Console(record=True, width=100)
    console.print(table)
    return console.export_text()


def test_summary_table_renders_every_field():
    text = render(summary_table(SUMMARY))
    for expected in ("steps", "20", "final loss", "0.5000", "12,345.6", "MFU", "41.23%", "HFU", "50.00%",
                     "3.00 GiB", "OOM events", "1 (12.3 s lost)", "planning overhead", "1.23%"):
        assert expected in text, expected
    assert render(summary_table({"summary": True, "mfu": None})).count("n/a") == 11  # every row, policy included


def test_print_summary_rank_zero_only(capsys):
    print_summary(SUMMARY, rank=1)
    assert capsys.readouterr() == ("", "")
    print_summary(SUMMARY, rank=0)
    out, err = capsys.readouterr()
    assert out == "" and "41.23%" in err


def test_human_bytes_and_schema():
    assert [human_bytes(v) for v in (0, 1023, 1536, 5 * 2 ** 40, None, math.nan)] == \
        ["0 B", "1023 B", "1.50 KiB", "5.00 TiB", "n/a", "n/a"]
    assert SUMMARY_FIELDS[0] == "summary" and set(SUMMARY) == set(SUMMARY_FIELDS)
    assert {"step", "mfu", "hfu", "oom", "microbatches"} <= set(STEP_FIELDS)
    assert "imbalance" in MICROBATCH_FIELDS
