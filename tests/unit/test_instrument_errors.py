"""instrument / trace_graph / apply_plan on a model of your own: bad input is one clear ValueError (one line naming
the field and what is allowed); the gate callable runs after each router, once per forward, never in backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bagualu2.costmodel import Plan, evaluate, presets
from bagualu2.exec import apply_plan, instrument
from byom_model import OP_MAP, make

HW = presets.hardware("cpu")


def one_line(excinfo) -> str:
    text = str(excinfo.value)
    assert "\n" not in text and text
    return text


def test_a_pattern_that_matches_nothing():
    model, _ = make()
    with pytest.raises(ValueError) as excinfo:
        instrument(model, {**OP_MAP, "layers.*.feed_forward": "mlp_fc1"})
    assert "'layers.*.feed_forward' matches no module" in one_line(excinfo)


def test_a_module_named_twice():
    model, _ = make()
    with pytest.raises(ValueError) as excinfo:
        instrument(model, {**OP_MAP, "layers.0.attn.*": "qkv"})
    assert "names module 'layers.0.attn.w" in one_line(excinfo) and "twice" in one_line(excinfo)


@pytest.mark.parametrize("label", ["", "a b", "x:not_a_kind", 3])
def test_bad_labels(label):
    model, _ = make()
    with pytest.raises(ValueError) as excinfo:
        instrument(model, {"layers.*.attn_norm": label})
    assert "op_map" in one_line(excinfo)


def test_any_name_is_a_generic_op_and_name_kind_chooses_the_kind():
    model, x = make()
    instrumented = instrument(model, {"layers.*.attn_norm": "pre_norm", "layers.*.ffn_norm": "post:norm"})
    graph = instrumented.trace_graph(x, hardware=HW)
    assert graph.op("L0.pre_norm").kind == "residual" and graph.op("L1.post").kind == "norm"
    assert instrumented.trace.unmapped_bytes > 0  # everything else is outside the op map


def test_a_model_on_an_unsupported_device():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError) as excinfo:
        instrument(model, {"0": "qkv"})
    assert "device 'meta'" in one_line(excinfo) and "cpu, cuda" in one_line(excinfo)


class Dropping(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.drop, self.fc2 = nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 8)

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


def test_recompute_of_a_non_deterministic_module():
    torch.manual_seed(0)
    model = nn.Sequential(Dropping())
    instrumented = instrument(model, {"0.fc1": "mlp_fc1", "0.act": "relu:mlp_act", "0.drop": "dropout:mlp_act",
                                         "0.fc2": "mlp_fc2"})
    x = torch.randn(4, 8, requires_grad=True)
    graph = instrumented.trace_graph(x, hardware=HW)
    assert instrumented.trace.random_ops == {"L0.dropout"}
    made = [f"{op.name}/{s.tensor}" for op, s in graph.savings if s.tensor.startswith("L0.dropout.")]
    assert made and all(graph.tensors[t.split("/")[1]].producer is None for t in made)  # never re-run
    with pytest.raises(ValueError) as excinfo:
        apply_plan(instrumented, ",".join(f"{t}=RECOMPUTE" for t in made))
    assert "draws random numbers" in one_line(excinfo) and "deterministic" in one_line(excinfo)
    apply_plan(instrumented, "mlp_act=RECOMPUTE")  # the kind policy re-runs what it can: not the dropout
    apply_plan(instrumented, "mlp_act=OFFLOAD")  # offloading it is fine
    model.eval()  # no dropout: deterministic
    instrumented.trace_graph(x, hardware=HW)
    assert not instrumented.trace.random_ops
    apply_plan(instrumented, "mlp_act=RECOMPUTE")
    assert graph.ops


def test_a_container_whose_mapped_child_draws_random_numbers_is_not_re_run():
    """Re-running a container re-runs its mapped children: a dropout inside makes the container random too."""
    def run(plan):
        model.zero_grad(set_to_none=True)
        executor = apply_plan(instrumented, plan)
        torch.manual_seed(123)
        with executor.micro_batch("m") as record:
            out = model(x)
        out.pow(2).mean().backward()
        executor.release("m")
        return record, [p.grad.clone() for p in model.parameters()]

    torch.manual_seed(0)
    model = nn.Sequential(Dropping())
    instrumented = instrument(model, {"0": "core_attn", "0.drop": "dropout:mlp_act"})
    x = torch.randn(4, 8)
    graph = instrumented.trace_graph(x, hardware=HW)
    assert instrumented.trace.random_ops == {"L0.core_attn", "L0.dropout"}
    made = [f"{op.name}/{s.tensor}" for op, s in graph.savings if graph.tensors[s.tensor].producer is None
            and s.tensor.startswith("L0.core_attn.")]
    assert made  # what the container makes is never regenerated
    with pytest.raises(ValueError) as excinfo:
        apply_plan(instrumented, ",".join(f"{t}=RECOMPUTE" for t in made))
    assert "draws random numbers" in one_line(excinfo)
    _, plain = run(None)
    record, mitigated = run("core_attn=RECOMPUTE")  # the kind policy re-runs what it can: nothing here
    assert record.device_bytes == evaluate(graph, Plan.from_str("core_attn=RECOMPUTE")).activation_bytes
    assert all(torch.equal(a, b) for a, b in zip(mitigated, plain))


def test_an_interrupt_inside_a_mapped_module_leaves_no_scope_open():
    """torch closes a module's always-call hooks for ``Exception`` only: a ``KeyboardInterrupt`` (Ctrl-C) in a mapped
    module's forward must not leave its op scope set for the traces and micro-batches after it."""
    from bagualu2.exec.scope import FRAME

    model, x = make()
    instrumented = instrument(model, OP_MAP)
    reference = instrumented.trace_graph(x, hardware=HW)
    attn = model.layers[1].attn
    interrupt = attn.register_forward_pre_hook(lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # in its scope
    with pytest.raises(KeyboardInterrupt):
        instrumented.trace_graph(x, hardware=HW)
    assert FRAME.get() is None
    executor = apply_plan(instrumented, "norm=OFFLOAD")
    with pytest.raises(KeyboardInterrupt):
        with executor.micro_batch("interrupted"):
            model(x)
    assert FRAME.get() is None and "interrupted" not in executor
    interrupt.remove()
    again = instrumented.trace_graph(x, hardware=HW)
    assert again.unmitigated_bytes == reference.unmitigated_bytes and again.savings == reference.savings
    executor = apply_plan(instrumented, "norm=OFFLOAD")
    with executor.micro_batch("m") as record:
        out = model(x)
    assert record.device_bytes == evaluate(again, Plan.from_str("norm=OFFLOAD")).activation_bytes
    out.float().pow(2).mean().backward()
    instrumented.remove()


def test_misuse_of_executors_is_one_line():
    from bagualu2.exec import ActivationTracker

    model, x = make()
    instrumented = instrument(model, OP_MAP)
    instrumented.trace_graph(x, hardware=HW)
    for keyword, value, message in (("tracker", "x", "tracker must be an ActivationTracker"),
                                    ("exclude", 3, "exclude must be an iterable of torch modules"),
                                    ("exclude", model, "exclude must be an iterable of torch modules"),
                                    ("deferred", "x", "deferred must be a DeferredPlanner"),
                                    ("graph", "x", "graph must be an OpGraph")):
        with pytest.raises(ValueError) as excinfo:
            apply_plan(instrumented, None, **{keyword: value})
        assert message in one_line(excinfo)
    executor, other = apply_plan(instrumented, "norm=OFFLOAD"), apply_plan(instrumented, None)
    for name in (None, ["a"], True):
        with pytest.raises(ValueError, match="names are strings or integers"):
            with executor.micro_batch(name):
                pass
    for outer, inner in ((executor, executor), (executor, other)):  # saved-tensor hooks do not nest
        with pytest.raises(ValueError) as excinfo:
            with outer.micro_batch("outer"):
                with inner.micro_batch("inner"):
                    model(x)
        assert "do not nest" in one_line(excinfo) and "outer" not in executor and "inner" not in inner
    tracker = ActivationTracker(exclude=[model])
    with pytest.raises(ValueError, match="do not nest"):
        with executor.micro_batch("outer"):
            with tracker.micro_batch("inner"):
                pass
    instrumented.trace_graph(x * 2, hardware=HW)  # traced again: the executors name savings of the earlier trace
    with pytest.raises(ValueError) as excinfo:
        with executor.micro_batch("stale"):
            pass
    assert "traced again" in one_line(excinfo)
    with apply_plan(instrumented, "norm=OFFLOAD").micro_batch(0):  # a new one runs
        model(x)
    with pytest.raises(ValueError) as excinfo:  # another autocast than the trace's: the savings' dtypes differ
        with apply_plan(instrumented, "norm=OFFLOAD").micro_batch(1), torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
    assert "runs under autocast cpu torch.bfloat16, but the model was traced under autocast off" in one_line(excinfo)
    executor = apply_plan(instrumented, "norm=OFFLOAD")
    for shape in ((2 * x.shape[0], *x.shape[1:]), (x.shape[0], x.shape[1] // 2, *x.shape[2:])):
        with pytest.raises(ValueError) as excinfo:  # another batch size or length: the plan's bytes are not kept
            with executor.micro_batch(f"{shape}"):
                model(torch.randn(shape, requires_grad=True))
        assert "savings have other sizes than traced" in one_line(excinfo)
        assert "the input's shape, or its path through the model" in one_line(excinfo)
    with executor.micro_batch(3) as record:  # the traced shape runs on the same executor
        loss = model(torch.randn(x.shape, requires_grad=True)).sum()
    loss.backward()
    assert not record.slot_size_misses and record.slot_fixed > 0
    executor.release(3)
    for body, message in ((lambda: model(x).sum().backward(), "backward ran inside its micro_batch block"),
                          (lambda: (model(x), model(x)), "ran 2 times, 1 in the traced forward"),
                          (lambda: instrumented.trace_graph(x, hardware=HW), "trace_graph runs outside")):
        with pytest.raises(ValueError) as excinfo:
            with executor.micro_batch("misused"):
                body()
        assert message in one_line(excinfo) and "misused" not in executor
    model.to(torch.bfloat16)  # cast after the trace: the plan's savings are not what the model saves now
    with pytest.raises(ValueError) as excinfo:
        with apply_plan(instrumented, "norm=OFFLOAD").micro_batch(2):
            model(x.detach().to(torch.bfloat16))
    assert "other dtypes than their traced slots" in one_line(excinfo)
    instrumented.remove()


def test_recompute_of_a_graph_input_and_routing_from_fp8():
    model, x = make()
    instrumented = instrument(model, OP_MAP)
    with pytest.raises(ValueError) as excinfo:
        apply_plan(instrumented, None)
    assert "trace_graph" in one_line(excinfo)
    graph = instrumented.trace_graph(x, hardware=HW)
    entry = next(f"{op}/{t}" for op, t in graph.decisions if graph.tensors[t].producer is None)
    with pytest.raises(ValueError) as excinfo:
        apply_plan(instrumented, f"{entry}=RECOMPUTE")
    assert "no re-run of a mapped module makes" in one_line(excinfo)
    # the MoE block (top-k, torch.where) re-run from an FP8 copy of its input would route differently
    own = next(t for t in (s.tensor for s in graph.op("L1.moe").saves) if graph.tensors[t].producer == "L1.moe")
    fp8 = ",".join(f"{op}/L1.norm2.out0=QUANTIZE" for op, _ in graph.consumers("L1.norm2.out0"))
    with pytest.raises(ValueError) as excinfo:
        apply_plan(instrumented, f"L1.moe/{own}=RECOMPUTE,{fp8}")
    assert "depend on values" in one_line(excinfo) and "L1.norm2.out0" in one_line(excinfo)
    apply_plan(instrumented, f"L1.moe/{own}=RECOMPUTE")  # from the kept input: fine


def test_trace_graph_checks_its_arguments():
    model, x = make()
    instrumented = instrument(model, OP_MAP)
    for loss, message in ((3, "loss must be a callable"), (lambda out: out.sum(-1), "one-element tensor"),
                          (lambda out: 1.0, "one-element tensor")):
        with pytest.raises(ValueError) as excinfo:
            instrumented.trace_graph(x, hardware=HW, loss=loss)
        assert message in one_line(excinfo)
    with torch.no_grad(), pytest.raises(ValueError) as excinfo:
        instrumented.trace_graph(x, hardware=HW)
    assert "outside torch.no_grad()" in one_line(excinfo)
    model.requires_grad_(False)  # a frozen model traced through its input: gradients computed, not accumulated
    instrumented.trace_graph(x, hardware=HW)
    assert x.grad is None
    with pytest.raises(ValueError) as excinfo:
        instrumented.trace_graph(x, hardware="cpu")
    assert "hardware" in one_line(excinfo)
    with pytest.raises(ValueError) as excinfo:
        instrumented.trace_graph(x.detach(), hardware=HW, timed=1)
    assert "timed" in one_line(excinfo)
    with pytest.raises(ValueError):
        instrument(model, OP_MAP, gate=3)
    with pytest.raises(ValueError):
        instrument(model, {})
    instrumented.remove()
    with pytest.raises(ValueError) as excinfo:
        instrumented.trace_graph(x, hardware=HW)
    assert "hooks were removed" in one_line(excinfo)


@pytest.mark.slow
def test_the_gate_runs_after_each_router_in_forward_only():
    model, x = make()
    seen = []

    def gate(router, inputs, output):
        seen.append((router, output.shape))
        return output.shape[0] * 2  # routed copies: T * top_k

    instrumented = instrument(model, OP_MAP, gate=gate)
    graph = instrumented.trace_graph(x, hardware=HW)
    # tracing asks each router for its routed copies, the graph's counts; it decides nothing
    assert [r for r, _ in seen] == [model.layers[1].moe.gate]
    assert graph.mean_routed_tokens == seen[0][1][0] * 2
    assert dict(graph.layer_routed_tokens) == {1: graph.mean_routed_tokens}
    seen.clear()
    executor = apply_plan(instrumented, "expert_act=RECOMPUTE,router=RECOMPUTE")
    with executor.micro_batch("mb0"):
        out = model(x)
    assert [r for r, _ in seen] == [model.layers[1].moe.gate]
    out.sum().backward()  # replays in backward do not report gates again
    assert len(seen) == 1
    executor.release("mb0")
    instrumented.remove()
    model(x)
    assert len(seen) == 1  # hooks off: the gate is not asked any more
    with pytest.raises(ValueError, match="hooks were removed"):  # nor would the plan apply: refused, not ignored
        with executor.micro_batch("mb1"):
            model(x)
    with pytest.raises(ValueError, match="hooks were removed"):
        apply_plan(instrumented, "expert_act=RECOMPUTE")
    again = instrument(model, OP_MAP, gate=gate)  # after remove() the model may be instrumented again
    with pytest.raises(ValueError, match="instrumented already"):
        instrument(model, OP_MAP)
    again.remove()


class _Counting(nn.Module):
    """A module with a side effect the trace cannot see: its output depends on how often it ran."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.proj(x)) * self.calls


def test_verify_names_the_op_whose_re_run_differs_from_its_forward():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), _Counting(), nn.Linear(8, 8))
    instrumented = instrument(model, {"0": "first", "1": "counted", "2": "last"})
    x = torch.randn(4, 8, requires_grad=True)
    graph = instrumented.trace_graph(x, hardware=HW)
    counted = graph.op("L1.counted")  # the layer of a module is the first integer of its path
    plan = ",".join(f"{counted.name}/{s.tensor}=RECOMPUTE" for s in counted.saves
                    if graph.tensors[s.tensor].producer == counted.name)
    executor = apply_plan(instrumented, plan, verify=True)
    with executor.micro_batch("mb"):
        out = model(x)
    with pytest.raises(RuntimeError, match="verify: re-running L1.counted gave outputs that differ"):
        out.sum().backward()
    executor.release("mb")
    with pytest.raises(ValueError, match="verify must be True or False"):
        apply_plan(instrumented, plan, verify="yes")


@pytest.mark.parametrize("bad", ["12", -1, 2.5, True, (1, None, None, -3), (1, 2, 3, 4, 5), None])
def test_a_gate_report_that_is_not_a_count_is_one_line(bad):
    from bagualu2.exec.ops import GateReport, gate_report

    with pytest.raises(ValueError, match="gate: the router's report"):
        gate_report(bad)
    assert gate_report(7) == GateReport(7) and gate_report((7, None, None, 4)).sent == 4
    assert gate_report(torch.tensor(7)).received == 7


@pytest.mark.parametrize("deferred", [False, True])
def test_a_micro_batch_released_before_its_backward_keeps_its_host_copies(deferred):
    """``release`` before the backward (a misuse) must not hand the host buffers of an OFFLOAD plan to the pool: a
    later micro-batch would overwrite them and the backward read the wrong activations; a deferred offload that
    never ran keeps its device storage."""
    plain, x = make()
    plain(x).float().pow(2).mean().backward()
    model, x = make()
    instrumented = instrument(model, OP_MAP)
    instrumented.trace_graph(x, hardware=HW)
    executor = apply_plan(instrumented, "norm=OFFLOAD")
    executor.defer_offloads = deferred
    with executor.micro_batch("early") as record:
        out = model(x)
    assert record.host_bytes > 0 or deferred
    executor.release("early")
    with executor.micro_batch("next"):
        model(make(seed=1)[1])  # reuses whatever the pool holds
    out.float().pow(2).mean().backward()
    for mine, reference in zip(model.parameters(), plain.parameters()):
        assert torch.equal(mine.grad, reference.grad)
    instrumented.remove()


def test_a_model_is_instrumented_once_whole_or_in_part():
    model, x = make()
    instrumented = instrument(model, OP_MAP)
    outer = nn.ModuleDict({"inner": model})
    for target, op_map in ((model.layers[0], {"attn_norm": "norm1"}), (outer, {"inner.layers.*.attn_norm": "norm1"})):
        with pytest.raises(ValueError) as excinfo:
            instrument(target, op_map)
        assert "instrumented already" in one_line(excinfo)
    graph = instrumented.trace_graph(x, hardware=HW)
    other, _ = make()
    with pytest.raises(ValueError) as excinfo:  # a graph of other ops than the model's: nothing would apply
        apply_plan(instrument(other, {"layers.*.attn_norm": "pre"}), "norm=OFFLOAD", graph=graph)
    assert "the plan mitigates ops the instrumented model does not have: L0.norm1" in one_line(excinfo)
    instrumented.remove()
    instrument(model.layers[0], {"attn_norm": "norm1"}).remove()  # the hooks are off: it can be again


def test_apply_plan_on_the_bare_model_says_what_to_pass():
    model, _ = make()
    instrument(model, OP_MAP)
    with pytest.raises(ValueError, match=r"^target: .* pass the InstrumentedModel that instrumenting it returned"):
        apply_plan(model, None)
