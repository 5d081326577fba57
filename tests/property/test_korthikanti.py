"""Dense-layer activation bytes equal Korthikanti et al. 2022 (fp16, no flash attention, dropout masks)."""

from hypothesis import given
from hypothesis import strategies as st

from bagualu2.costmodel import ModelConfig, ParallelConfig, Plan, Strategy, build_graph, evaluate, presets

HW = presets.hardware("paper-gpu")


@st.composite
def korthikanti_layer(draw, tp_choices=(1,)):
    t = draw(st.sampled_from(tp_choices))
    heads = t * draw(st.integers(1, 8))
    head_dim = draw(st.integers(1, 24))
    h = heads * head_dim
    s = t * draw(st.integers(1, 48))
    b = draw(st.integers(1, 4))
    layers = draw(st.integers(1, 3))
    model = ModelConfig(num_layers=layers, hidden_size=h, num_attention_heads=heads, num_query_groups=heads,
                        head_dim=head_dim, ffn_hidden_size=4 * h, vocab_size=128, seq_length=s,
                        micro_batch_size=b, dtype="fp16", flash_attention=False, activation="gelu",
                        normalization="layernorm", hidden_dropout=0.1, attention_dropout=0.1)
    return model, t


@given(korthikanti_layer())
def test_no_parallelism(case):
    model, _ = case
    s, b, h, a = model.seq_length, model.micro_batch_size, model.hidden_size, model.num_attention_heads
    graph = build_graph(model, ParallelConfig(), HW)
    # s*b*h*(34 + 5*a*s/h) bytes per layer
    assert graph.unmitigated_bytes == model.num_layers * (34 * s * b * h + 5 * a * s * s * b)


@given(korthikanti_layer(tp_choices=(2, 4, 8)))
def test_tensor_parallel(case):
    model, t = case
    s, b, h, a = model.seq_length, model.micro_batch_size, model.hidden_size, model.num_attention_heads
    graph = build_graph(model, ParallelConfig(tp=t, dp=1), HW)
    # s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes per layer
    assert graph.unmitigated_bytes * t == model.num_layers * (10 * s * b * h * t + 24 * s * b * h + 5 * a * s * s * b)


@given(korthikanti_layer(tp_choices=(2, 4, 8)))
def test_tensor_sequence_parallel_selective_recompute(case):
    model, t = case
    s, b, h = model.seq_length, model.micro_batch_size, model.hidden_size
    graph = build_graph(model, ParallelConfig(tp=t, sequence_parallel=True), HW)
    # selective recompute: the attention core's own tensors (softmax, its dropout mask and output)
    internal = {(op.name, sv.tensor): Strategy.RECOMPUTE for op in graph.ops if op.kind == "core_attn"
                for sv in op.saves if graph.tensors[sv.tensor].producer == op.name}
    cost = evaluate(graph, Plan.from_decisions(internal))
    # 34*s*b*h/t bytes per layer
    assert cost.activation_bytes * t == model.num_layers * 34 * s * b * h
    assert evaluate(graph, Plan.uniform({"core_attn": Strategy.RECOMPUTE})) == cost  # the same, as a kind policy
    assert cost.recompute_ns == sum(op.forward_ns for op in graph.ops if op.kind == "core_attn")
