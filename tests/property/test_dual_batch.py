"""DualBatchExecutor: any order that keeps each chain's order gives the gradients of sequential execution.

Four micro-batches of tiny-moe under a plan with OFFLOAD and RECOMPUTE (so all four chains exist): mb0..mb2 run
forward, then the scheduling point F(mb3) B(mb0) O(mb2) R(mb1) runs in the order under test, then the remaining
backwards. Gradients (accumulated over the four micro-batches in the same order) and the forward output of mb3 must
be bitwise those of plain sequential execution, for random valid orders (hypothesis), the DP's order and the
baselines'.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from conftest import scaled
from hypothesis import strategies as st

from bagualu2.costmodel import ParallelConfig, build_graph, presets
from bagualu2.exec import apply_plan
from bagualu2.exec.dual import DualBatchExecutor
from bagualu2.fusion import CHAIN_KINDS, Order, baselines, build_chains, dp
from reference_trainer.instrumented import instrument_reference
from reference_trainer.model import GLMMoEModel

PLAN = "core_attn=OFFLOAD,expert_act=RECOMPUTE,L1.qkv/L1.norm1_out=OFFLOAD,L2.core_attn/L2.attn_lse=RECOMPUTE"
CONFIG = presets.model("tiny-moe")[0].replace(seq_length=32)
HARDWARE = presets.hardware("cpu")
GRAPH = build_graph(CONFIG, ParallelConfig(), HARDWARE)
CHAINS = build_chains(GRAPH, PLAN, GRAPH, PLAN, hardware=HARDWARE)


def _inputs():
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(CONFIG.micro_batch_size, CONFIG.seq_length, CONFIG.hidden_size, generator=generator)
            for _ in range(4)]


def _model():
    torch.manual_seed(0)
    model = GLMMoEModel(CONFIG)
    instrument_reference(model)
    return model


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _sequential():
    model, inputs = _model(), _inputs()
    executor = apply_plan(GRAPH, PLAN, exclude=[model])
    losses = []
    for i, x in enumerate(inputs):
        with executor.micro_batch(f"mb{i}"):
            out = model.forward_layers(x)
        losses.append(out.pow(2).mean())
    for i, loss in enumerate(losses):
        loss.backward()
        executor.release(f"mb{i}")
    return _grads(model), out.detach()


def _three_in_flight():
    """The model, its inputs, a dual-batch executor over an executor with mb0..mb2 forwarded (mb0 and mb1 offloaded
    by earlier points); made before the forwards, whose ops then get the backward's stage hooks."""
    model, inputs = _model(), _inputs()
    executor = apply_plan(GRAPH, PLAN, exclude=[model])
    dual = DualBatchExecutor(executor)
    losses = []
    for i in range(3):
        with executor.micro_batch(f"mb{i}"):
            losses.append(model.forward_layers(inputs[i]).pow(2).mean())
    executor.offload_now("mb0")
    executor.offload_now("mb1")
    return model, inputs, executor, dual, losses


def _fused(order):
    model, inputs, executor, dual, losses = _three_in_flight()
    result = dual.run(order, CHAINS, forward=("mb3", lambda: model.forward_layers(inputs[3])),
                      backward=("mb0", losses[0]), offload="mb2", recovery="mb1")
    executor.release("mb0")
    losses.append(result.forward.pow(2).mean())
    executor.offload_now("mb2")
    for i in range(1, 4):
        losses[i].backward()
        executor.release(f"mb{i}")
    return _grads(model), result.forward.detach(), result


REFERENCE = None


def _check(order):
    global REFERENCE
    if REFERENCE is None:
        REFERENCE = _sequential()
    grads0, out0 = REFERENCE
    grads1, out1, result = _fused(order)
    assert result.stages == [f"{k}{i}" for group in order.groups for k, i in group]
    assert torch.equal(out0, out1)
    assert grads0.keys() == grads1.keys()
    for name, g0 in grads0.items():
        assert torch.equal(g0, grads1[name]), name
    return result


def test_chains_have_all_four_kinds():
    assert all(CHAINS.get(kind) is not None for kind in CHAIN_KINDS)
    assert len(CHAINS.forward) > 3  # split at the all-to-alls


@pytest.mark.slow
@pytest.mark.parametrize("solver", ["dp", "sequential", "megatron_core", "megatron_kwai"])
def test_solver_orders(solver):
    order = dp.solve(CHAINS) if solver == "dp" else getattr(baselines, solver)(CHAINS)
    result = _check(order)
    assert result.forward_ops[0] == "L0.norm1" and result.forward_ops[-1] == "L3.residual2"


@pytest.mark.slow
def test_stages_really_interleave():
    """The gates hold each worker at its stage boundaries: the trace follows the order, not the threads."""
    forward_first = baselines.sequential(CHAINS)  # F..., B..., O..., R...
    kinds = [k for k, _ in _check(forward_first).trace]
    assert kinds == sorted(kinds, key="FB".index)  # every forward op before any backward op
    backward_first = Order(tuple((("B", i),) for i in range(len(CHAINS.backward)))
                           + tuple((("F", i),) for i in range(len(CHAINS.forward)))
                           + tuple((("O", i),) for i in range(len(CHAINS.offload)))
                           + tuple((("R", i),) for i in range(len(CHAINS.recovery))), barriers=False)
    kinds = [k for k, _ in _check(backward_first).trace]
    assert kinds == sorted(kinds, key="BF".index) and "F" in kinds and "B" in kinds


@st.composite
def valid_orders(draw):
    remaining = {k: len(CHAINS.get(k)) for k in CHAIN_KINDS}
    position = dict.fromkeys(CHAIN_KINDS, 0)
    barriers = draw(st.booleans())
    groups: list[list[tuple[str, int]]] = []
    while any(remaining.values()):
        kind = draw(st.sampled_from([k for k in CHAIN_KINDS if remaining[k]]))
        ref = (kind, position[kind])
        position[kind] += 1
        remaining[kind] -= 1
        join = barriers and groups and kind not in {k for k, _ in groups[-1]} and draw(st.booleans())
        if join:
            groups[-1].append(ref)
        else:
            groups.append([ref])
    return Order(tuple(tuple(g) for g in groups), barriers=barriers)


@pytest.mark.slow
@settings(max_examples=scaled(12))
@given(valid_orders())
def test_random_valid_orders_match_sequential(order):
    _check(order)


def test_invalid_orders_are_refused():
    model = _model()
    dual = DualBatchExecutor(apply_plan(GRAPH, PLAN, exclude=[model]))
    swapped = Order(((("F", 1),), (("F", 0),)), barriers=False)
    with pytest.raises(ValueError, match="out of its chain's order"):
        dual.run(swapped, CHAINS, forward=("x", lambda: None), backward=("y", torch.zeros(())), offload="a",
                 recovery="b")
    with pytest.raises(ValueError, match="no micro-batch was given"):
        dual.run(dp.solve(CHAINS), CHAINS, forward=("x", lambda: None))


def test_an_error_ends_the_point_at_once_and_the_other_worker_runs_nothing_more():
    """A stage that fails (an out-of-memory error, say) ends the point: the backward worker, parked at its next
    stage, is released with PointAborted and runs no further op, so a rank never runs ahead into collectives its
    group is not issuing."""
    from bagualu2.exec.dual import PointAborted

    model, inputs, executor, dual, losses = _three_in_flight()
    last = model.layers[len(model.layers) - 1]
    handle = last.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(RuntimeError("boom")))
    backward_first = Order(((("B", 0),),) + tuple((("F", i),) for i in range(len(CHAINS.forward)))
                           + tuple((("B", i),) for i in range(1, len(CHAINS.backward)))
                           + tuple((("O", i),) for i in range(len(CHAINS.offload)))
                           + tuple((("R", i),) for i in range(len(CHAINS.recovery))), barriers=False)
    backward_error: list[BaseException] = []

    def backward():
        try:
            losses[0].backward()
        except BaseException as exc:
            backward_error.append(exc)
            raise

    with pytest.raises(RuntimeError, match="boom"):
        dual.run(backward_first, CHAINS, forward=("mb3", lambda: model.forward_layers(inputs[3])),
                 backward=("mb0", backward), offload="mb2", recovery="mb1")
    handle.remove()
    assert backward_error and isinstance(backward_error[0], PointAborted)
    first_layer = [p.grad for p in model.layers[0].parameters()]
    assert all(g is None for g in first_layer)  # the backward never reached layer 0
    assert any(p.grad is not None for p in last.parameters())  # its first stage did run


@pytest.mark.slow
def test_the_backward_is_held_at_its_stage_boundaries_too():
    """An alternating order F0 B0 F1 B1 ...: both workers stop at every stage boundary, so the trace switches
    between forward and backward ops at least once per stage pair (a backward that ran through in one go would
    switch once)."""
    stages = max(len(CHAINS.forward), len(CHAINS.backward))
    groups = []
    for i in range(stages):
        groups += [(("F", i),)] if i < len(CHAINS.forward) else []
        groups += [(("B", i),)] if i < len(CHAINS.backward) else []
    order = Order(tuple(groups) + tuple((("O", i),) for i in range(len(CHAINS.offload)))
                  + tuple((("R", i),) for i in range(len(CHAINS.recovery))), barriers=False)
    kinds = [k for k, _ in _check(order).trace]
    switches = sum(a != b for a, b in zip(kinds, kinds[1:]))
    assert switches >= min(len(CHAINS.forward), len(CHAINS.backward)), switches


def test_an_op_that_issued_a_collective_lets_the_other_micro_batch_run_before_it_waits():
    """``exec.overlap_point()`` inside F's dispatch (where an asynchronous all-to-all would be in flight) ends F's
    stage early: the order's next stage, B's compute, runs before F's dispatch finishes, and everything is still
    bitwise sequential execution's."""
    from bagualu2.exec import overlap_point

    seen = []

    def issued(module, args, output):
        seen.append(module)
        overlap_point()

    original = _model

    def model_with_hook():
        model = original()
        model.layers[1].mlp.dispatch.register_forward_hook(issued)
        return model

    globals()["_model"] = model_with_hook
    try:
        grads, out, result = _fused(dp.solve(CHAINS))
    finally:
        globals()["_model"] = original
    reference_grads, reference_out = _sequential()
    assert torch.equal(out, reference_out)
    assert all(torch.equal(g, grads[name]) for name, g in reference_grads.items())
    trace = result.trace
    park = trace.index(("F", "park:1"))  # F's stage 1 is L1.dispatch
    resumed = trace.index(("F", "L1.expert_fc1"))
    assert any(kind == "B" for kind, _ in trace[park + 1:resumed])  # B's stage 2 ran while the exchange was out
