"""``costmodel.rescale.at_imbalance`` against ``build_graph``: a graph resized from its own routed tensors is the
graph the model's configuration builds at that imbalance (every tensor, and the cost of any plan)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bagualu2.costmodel import OpGraph, build_graph, evaluate, presets
from bagualu2.costmodel.rescale import at_imbalance
from bagualu2.mitigation import greedy

MOE_PRESETS = [name for name in presets.model_names() if presets.model(name)[0].num_experts]
HARDWARE = presets.hardware(presets.hardware_names()[0])
# a preset whose chunk holds two MoE layers
TWO_MOE_LAYERS = next(name for name in MOE_PRESETS
                      if sum(op.kind == "router" for op in build_graph(*presets.model(name), HARDWARE).ops) == 2)
imbalances = st.floats(min_value=1.0, max_value=4.0, allow_nan=False).map(lambda r: round(r, 3))


@given(name=st.sampled_from(MOE_PRESETS), built=imbalances, target=imbalances, fraction=st.floats(0, 1))
def test_a_rescaled_graph_is_the_built_one(name, built, target, fraction):
    model, parallel = presets.model(name)
    built, target = min(built, parallel.ep), min(target, parallel.ep)  # at most ep: all the load on one rank
    source = build_graph(model, parallel, HARDWARE, imbalance=built)
    expected = build_graph(model, parallel, HARDWARE, imbalance=target)
    rescaled = at_imbalance(source, target)
    # a routed tensor holds routed_tokens(r) rows at each end: exact when the built graph's rows divide them
    assert {n: s.numel for n, s in rescaled.tensors.items()} == {n: s.numel for n, s in expected.tensors.items()}
    assert rescaled.imbalance == target and rescaled.mean_routed_tokens == source.mean_routed_tokens
    budget = source.floor_bytes + int((source.unmitigated_bytes - source.floor_bytes) * fraction)
    plan = greedy.solve(source, budget).plan
    assert evaluate(rescaled, plan).activation_bytes == evaluate(expected, plan).activation_bytes
    assert evaluate(source, plan).activation_bytes_at(source, target) == evaluate(expected, plan).activation_bytes
    for mine, built in zip(rescaled.ops, expected.ops):  # op times: estimates, within 2% of the built graph's
        assert abs(mine.forward_ns - built.forward_ns) <= 0.02 * built.forward_ns + 1
        assert abs(mine.backward_ns - built.backward_ns) <= 0.02 * built.backward_ns + 1


@given(received=st.dictionaries(st.sampled_from([0, 1]), st.integers(1, 400), min_size=2, max_size=2),
       target=imbalances)
def test_per_layer_counts_scale_each_layer_from_its_own(received, target):
    """A graph whose layers received different copies (a trace under expert parallelism) resizes each layer from
    its own count; activation_bytes_at agrees with the resized graph."""
    model, parallel = presets.model(TWO_MOE_LAYERS)
    base = build_graph(model, parallel, HARDWARE)
    rows = base.routed_tokens(1.0)
    layers = {base.tensor_layers[n] for n, s in base.tensors.items() if s.routed}
    assert len(layers) == 2
    counts = {layer: received[i] for i, layer in enumerate(sorted(layers))}
    tensors = {n: s._replace(numel=s.numel // rows * counts[base.tensor_layers[n]]) if s.routed else s
               for n, s in base.tensors.items()}
    traced = OpGraph(ops=base.ops, tensors=tensors, hardware=HARDWARE, pinned=base.pinned,
                     mean_routed_tokens=rows, layer_routed_tokens=counts)
    rescaled = at_imbalance(traced, target)
    expected = build_graph(model, parallel, HARDWARE, imbalance=target)
    assert {n: s.numel for n, s in rescaled.tensors.items()} == {n: s.numel for n, s in expected.tensors.items()}
    assert evaluate(traced).activation_bytes_at(traced, target) == expected.unmitigated_bytes


def test_what_cannot_be_rescaled_is_refused():
    model, parallel = presets.model("tiny-dense")
    with pytest.raises(ValueError, match="no routed token copies"):
        at_imbalance(build_graph(model, parallel, HARDWARE), 2.0)
    model, parallel = presets.model("tiny-moe")
    graph = build_graph(model, parallel, HARDWARE)
    with pytest.raises(ValueError, match="imbalance"):
        at_imbalance(graph, 0.5)
    layer = next(graph.tensor_layers[n] for n, s in graph.tensors.items() if s.routed)
    empty = OpGraph(ops=graph.ops, tensors=graph.tensors, hardware=HARDWARE, pinned=graph.pinned,
                    mean_routed_tokens=graph.mean_routed_tokens, layer_routed_tokens={layer: 0})
    with pytest.raises(ValueError, match=f"layer {layer} .* received no routed token copies"):
        at_imbalance(empty, 2.0)
    with pytest.raises(ValueError, match="layer_routed_tokens"):
        OpGraph(ops=graph.ops, tensors=graph.tensors, hardware=HARDWARE, layer_routed_tokens={0: -1})
