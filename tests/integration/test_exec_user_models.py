"""A user's own model under the exec layer, in the ways the reference model and the HF families do not exercise:
a module reading a buffer it then updates, a module changing its input in place, attention with an explicit mask,
a trace in another mode than the run, and torch's reentrant checkpointing. Exact strategies give the predicted
bytes and the plain run's gradients bit for bit, or the plan is refused in one line."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn

from bagualu2.costmodel import evaluate, presets
from bagualu2.exec import UntracedSavingsWarning, apply_plan, instrument

H = 16
CPU = presets.hardware("cpu")


class EmaScale(nn.Module):
    """Reads a running scale, then updates it (no_grad): a re-run must read it as the forward did."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H))
        self.register_buffer("ema", torch.ones(()))

    def forward(self, x):
        y = torch.tanh(x / self.ema * self.weight)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * x.abs().mean())
        return y


class DoublesInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(H, H)

    def forward(self, x):
        x.mul_(2.0)  # in place on its input, which the layer before made
        return F.gelu(self.lin(x))


class MaskedAttention(nn.Module):
    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.qkv, self.out, self.dropout = nn.Linear(H, 3 * H), nn.Linear(H, H), dropout

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, H // 2).permute(2, 0, 3, 1, 4)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        p = self.dropout if self.training else 0.0
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **({"dropout_p": p} if p else {}))
        return self.out(o.transpose(1, 2).reshape(b, t, H))


class Net(nn.Module):
    def __init__(self, middle: nn.Module):
        super().__init__()
        self.fc1, self.middle, self.fc2 = nn.Linear(H, H), middle, nn.Linear(H, H)

    def forward(self, x):
        return self.fc2(self.middle(self.fc1(x)))


def _step(model, inst, x, plan, state):
    model.load_state_dict(state)
    model.zero_grad()
    executor = apply_plan(inst, plan)
    with executor.micro_batch("mb") as record:
        out = model(x)
    out.pow(2).mean().backward()
    executor.release("mb")
    return record.device_bytes, [p.grad.clone() for p in model.parameters()]


def test_a_module_that_reads_a_buffer_it_updates_is_re_run_on_the_buffer_the_forward_read():
    torch.manual_seed(0)
    model, x = Net(EmaScale()), torch.randn(2, 8, H)
    inst = instrument(model, {"fc1": "mlp_fc1", "middle": "mlp_act", "fc2": "mlp_fc2"})
    state = {k: v.clone() for k, v in model.state_dict().items()}
    graph = inst.trace_graph(x, hardware=CPU)
    assert inst.trace.buffer_modules == {"middle"}
    _, plain = _step(model, inst, x, None, state)
    ema = model.middle.ema.clone()
    kept, grads = _step(model, inst, x, "mlp_act=RECOMPUTE", state)
    assert kept == evaluate(graph, "mlp_act=RECOMPUTE").activation_bytes < evaluate(graph, None).activation_bytes
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))  # 1e-3 apart when the re-run read the update
    assert torch.equal(model.middle.ema, ema)  # updated once, as the plain run does


def test_a_module_that_changes_its_input_in_place_is_never_re_run():
    torch.manual_seed(0)
    model, x = Net(DoublesInput()), torch.randn(2, 8, H, requires_grad=True)
    inst = instrument(model, {"fc1": "mlp_fc1", "middle": "mlp_act", "fc2": "mlp_fc2"})
    graph = inst.trace_graph(x, hardware=CPU)
    assert inst.trace.mutating_ops == {"mlp_act"}
    (saving,) = [s.tensor for s in graph.op("mlp_act").saves if s.tensor.startswith("mlp_act.")]  # its own
    with pytest.raises(ValueError, match=r"^plan: RECOMPUTE re-runs mlp_act \(module middle\), which changes its "
                                         r"input in place"):
        apply_plan(inst, f"mlp_act/{saving}=RECOMPUTE")  # a traceback inside the backward's re-run before


def test_attention_with_an_explicit_mask_and_no_dropout_is_deterministic():
    torch.manual_seed(0)
    model, x = Net(MaskedAttention()), torch.randn(2, 8, H, requires_grad=True)
    inst = instrument(model, {"fc1": "mlp_fc1", "middle": "core_attn", "middle.qkv": "qkv", "middle.out": "attn_out",
                              "fc2": "mlp_fc2"})
    state = {k: v.clone() for k, v in model.state_dict().items()}
    graph = inst.trace_graph(x, hardware=CPU)
    assert not inst.trace.random_ops  # the kernel's dropout_p left at its default of 0 drew nothing
    _, plain = _step(model, inst, x, None, state)
    kept, grads = _step(model, inst, x, "core_attn=RECOMPUTE", state)
    assert kept == evaluate(graph, "core_attn=RECOMPUTE").activation_bytes < evaluate(graph, None).activation_bytes
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))


def test_a_model_traced_in_eval_mode_is_refused_in_train_mode():
    torch.manual_seed(0)
    model, x = Net(MaskedAttention(dropout=0.2)), torch.randn(2, 8, H, requires_grad=True)
    inst = instrument(model, {"middle": "core_attn", "middle.qkv": "qkv", "middle.out": "attn_out"})
    model.eval()
    inst.trace_graph(x, hardware=CPU)
    model.train()
    executor = apply_plan(inst, "core_attn=RECOMPUTE")
    with pytest.raises(ValueError, match=r"^micro-batch 'mb' runs module middle in train mode, but the model was "
                                         r"traced in eval mode"):
        with executor.micro_batch("mb"):
            model(x)


def test_reentrant_checkpointing_is_one_line():
    class Checkpointed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(H, H), nn.Linear(H, H)

        def forward(self, x):
            return checkpoint.checkpoint(lambda t: torch.tanh(self.fc2(t)), torch.tanh(self.fc1(x)),
                                         use_reentrant=True)

    model = Checkpointed()
    inst = instrument(model, {"fc1": "mlp_fc1", "fc2": "mlp_fc2"})
    with pytest.raises(ValueError, match="^trace_graph: the model calls torch.utils.checkpoint with "
                                         "use_reentrant=True"):
        inst.trace_graph(torch.randn(2, 8, H, requires_grad=True), hardware=CPU)


class TinyMoE(nn.Module):
    """A softmax top-k router beside experts run in a loop (index_select / scatter_add)."""

    def __init__(self, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(H, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H))
                                     for _ in range(experts))

    def forward(self, x):
        tokens = x.reshape(-1, H)
        weights, picks = torch.topk(self.router(tokens).softmax(-1), self.top_k, dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = (picks == e).nonzero(as_tuple=True)
            y = expert(tokens.index_select(0, rows)) * weights[rows, slot].unsqueeze(-1)
            out = out.scatter_add(0, rows.unsqueeze(-1).expand_as(y), y)
        return out.reshape(x.shape)


MOE_MAP = {"fc1": "mlp_fc1", "middle": "moe", "middle.router": "router", "fc2": "mlp_fc2"}


def _counting_gate(router, inputs, output):
    """Recomputes the routing from the router's logits, with grad on where the caller leaves it on."""
    picks = torch.topk(output.softmax(-1), 2, dim=-1).indices
    return int(picks.numel())


def test_a_gate_that_computes_with_grad_saves_nothing_and_the_moe_block_re_runs():
    from bagualu2.exec import DeferredPlanner

    torch.manual_seed(0)
    model, x = Net(TinyMoE()), torch.randn(2, 8, H)
    inst = instrument(model, MOE_MAP, gate=_counting_gate)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    graph = inst.trace_graph(x, hardware=CPU)
    gateless = instrument(Net(TinyMoE()), MOE_MAP).trace_graph(x, hardware=CPU)
    assert graph.unmitigated_bytes == gateless.unmitigated_bytes  # the gate's softmax saved into the moe op before
    rerun = ",".join(f"moe/{saving.tensor}=RECOMPUTE" for saving in graph.op("moe").saves)
    _, plain = _step(model, inst, x, None, state)
    kept, grads = _step(model, inst, x, rerun, state)  # the re-run "saved fewer tensors" mid-backward before
    assert kept == evaluate(graph, rerun).activation_bytes < graph.unmitigated_bytes
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))
    other = instrument(Net(TinyMoE(experts=8)), MOE_MAP, gate=_counting_gate)
    foreign = DeferredPlanner.for_graph(other.trace_graph(x, hardware=CPU), budget_bytes=graph.floor_bytes)
    with pytest.raises(ValueError, match=r"^deferred: the planner decides on graph .* not on the graph the plan "
                                         r"runs on"):
        apply_plan(inst, None, deferred=foreign)  # decided on the other model's graph silently before


def test_a_cache_buffer_built_on_the_first_call_leaves_the_module_re_runnable():
    class Cached(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(H, H)
            self.register_buffer("scale", None)

        def forward(self, x):
            if self.scale is None:  # built on the first call (the trace), as rotary and mask caches are
                self.register_buffer("scale", torch.full((H,), 0.5))
            return torch.tanh(self.lin(x) * self.scale)

    torch.manual_seed(0)
    model, x = Net(Cached()), torch.randn(2, 8, H)
    inst = instrument(model, {"fc1": "mlp_fc1", "middle": "mlp_act", "fc2": "mlp_fc2"})
    graph = inst.trace_graph(x, hardware=CPU)
    assert not inst.trace.mutating_ops  # refused as "changes its input in place" when the list of buffers grew
    assert evaluate(graph, "mlp_act=RECOMPUTE").activation_bytes < graph.unmitigated_bytes
    state = {k: v.clone() for k, v in model.state_dict().items()}
    # the traced call built the buffer, the later ones read it: they save otherwise, and say so
    with pytest.warns(UntracedSavingsWarning, match="mlp_fc2"):
        _, plain = _step(model, inst, x, None, state)
        _, grads = _step(model, inst, x, "mlp_act=RECOMPUTE", state)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))


class UpcastNorm(nn.Module):
    """A bf16 RMS norm that computes in fp32: it saves its fp32 copy of the input, never the input itself."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(H, dtype=torch.bfloat16))

    def forward(self, x):
        wide = x.float()
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc0, self.norm, self.fc1, self.fc2 = nn.Linear(H, H), UpcastNorm(), nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x):
        h = self.fc0(x) + 1.0  # made between ops (fc0 is none): no op makes it, the norm keeps only its fp32 copy
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


def test_an_op_whose_input_nothing_keeps_is_never_re_run():
    """What such an op makes has no producer in the traced graph: kept, offloaded or quantised, never recomputed
    (a re-run in backward would find no input); every greedy plan keeps its predicted bytes, gradients bitwise."""
    from bagualu2.mitigation import greedy

    torch.manual_seed(0)
    model, x = Residual().to(torch.bfloat16), torch.randn(2, 8, H, dtype=torch.bfloat16)
    inst = instrument(model, {"norm": "norm2", "fc1": "mlp_fc1", "fc2": "mlp_fc2"})
    graph = inst.trace_graph(x, hardware=CPU)
    made = [name for name, spec in graph.tensors.items() if name.startswith("norm2.")]
    assert made and all(graph.tensors[name].producer is None for name in made)
    assert evaluate(graph, "norm2/norm2.saved0=RECOMPUTE").unavailable == ("norm2.saved0",)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    _, plain = _step(model, inst, x, None, state)
    with pytest.raises(ValueError, match="RECOMPUTE would regenerate norm2.saved0, which no re-run"):
        _step(model, inst, x, "norm2/norm2.saved0=RECOMPUTE", state)
    for budget in (graph.floor_bytes, (graph.floor_bytes + graph.unmitigated_bytes) // 2):
        plan = greedy.solve(graph, budget).plan
        kept, grads = _step(model, inst, x, plan, state)
        assert kept == evaluate(graph, plan).activation_bytes <= budget
        assert all(torch.equal(a, b) for a, b in zip(plain, grads))


def test_remove_runs_every_restore_even_when_one_fails():
    model = Net(nn.Identity())
    inst = instrument(model, {"fc1": "mlp_fc1", "fc2": "mlp_fc2"})
    ran = []

    def broken():
        raise RuntimeError("restore failed")

    for restore in (lambda: ran.append("first"), broken, lambda: ran.append("last")):
        inst.on_remove(restore)
    with pytest.raises(RuntimeError, match="restore failed"):
        inst.remove()
    assert ran == ["last", "first"] and inst.removed  # the latest first, and the one after the failure too
    with pytest.raises(ValueError, match="removed already"):
        inst.on_remove(lambda: None)
    with pytest.raises(ValueError, match="restore must be a callable"):
        instrument(model, {"fc1": "mlp_fc1"}).on_remove("later")


class LayerScaleAct(nn.Module):
    """``tanh(x * scale)``: the multiply saves ``x`` (another op's output) only while ``scale`` requires grad."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(H))

    def forward(self, x):
        return torch.tanh(x * self.scale) * 1.0


def test_a_module_that_saves_other_tensors_than_traced_never_gets_another_ops_tensor_back():
    """``scale.requires_grad_(False)`` after the trace: the call no longer saves its input, so its next saving (the
    tanh output) meets the slot where the trace saved the input, ``L0.mlp_fc1.out0``. Named so, a plan that
    re-runs ``mlp_fc1`` would hand backward fc1's output in place of the tanh output; it is kept as it is, and the
    micro-batch warns."""
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.ModuleDict(
                {"fc": nn.Linear(H, H), "act": LayerScaleAct(), "out": nn.Linear(H, H)})])

        def forward(self, x):
            layer = self.layers[0]
            return layer["out"](layer["act"](layer["fc"](x)))

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(4, H, requires_grad=True)
    instrumented = instrument(model, {"layers.*.fc": "mlp_fc1", "layers.*.act": "mlp_act", "layers.*.out": "mlp_fc2"})
    instrumented.trace_graph(x, hardware=CPU, loss=lambda y: y.pow(2).sum())
    model.layers[0]["act"].scale.requires_grad_(False)

    def run(plan):
        model.zero_grad(set_to_none=True)
        x.grad = None
        executor = apply_plan(instrumented, plan, verify=True)
        with executor.micro_batch("mb"):
            y = model(x)
        y.pow(2).sum().backward()
        executor.release("mb")
        return [p.grad.clone() for p in model.parameters() if p.grad is not None] + [x.grad.clone()]

    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = run(None)
    grads = run("L0.mlp_act/L0.mlp_fc1.out0=RECOMPUTE")
    assert len(grads) == len(plain) and all(torch.equal(a, b) for a, b in zip(grads, plain))
    assert any(issubclass(w.category, UntracedSavingsWarning) and "requires_grad" in str(w.message) for w in caught)


class Shifted(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)
        self.register_buffer("shift", torch.zeros(H))

    def forward(self, x, mask):
        # the mask is read, not saved (masked_fill saves the comparison's result): only a re-run reads it again
        return torch.tanh(self.fc(x) + self.shift).masked_fill(mask == 0, 0.0)


class ChangesAfter(nn.Module):
    """The parent advances its child's buffer after the child ran (a schedule); the loop refills a mask in place."""

    def __init__(self):
        super().__init__()
        self.a, self.b = Shifted(), nn.Linear(H, H)

    def forward(self, x, mask, *, advance: bool):
        out = self.b(self.a(x, mask))
        if advance:
            with torch.no_grad():
                self.a.shift.add_(0.5)
        return out


@pytest.mark.parametrize("change", ["buffer", "held argument"])
def test_a_rerun_whose_buffer_or_held_argument_changed_since_its_forward_is_refused(change):
    """A re-run reads buffers and arguments held as they are at backward time: changed in place since the forward,
    it would compute other values, so the backward stops in one line instead of giving wrong gradients."""
    torch.manual_seed(0)
    model = ChangesAfter()
    x, mask = torch.randn(2, 8, H), torch.ones(2, 8, H)
    instrumented = instrument(model, {"a": "mlp_fc1", "b": "mlp_fc2"})
    graph = instrumented.trace_graph(x, mask, advance=False, hardware=CPU, loss=lambda out: out.pow(2).mean())
    plan = "mlp_fc1=RECOMPUTE"
    assert not evaluate(graph, plan).unavailable
    executor = apply_plan(instrumented, plan)
    with executor.micro_batch("mb") as record:
        loss = model(x, mask, advance=change == "buffer").pow(2).mean()
    if change == "held argument":
        mask.mul_(0.5)  # the next micro-batch's mask, written into the same tensor before this one's backward
    with pytest.raises(RuntimeError, match=r"re-running mlp_fc1: 1 of the tensors it reads that are no activations"):
        loss.backward()
    executor.release(record.name)


class SelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.attn, self.post = nn.Linear(H, H), nn.MultiheadAttention(H, 4, batch_first=True), nn.Linear(H, H)

    def forward(self, x):
        h = self.pre(x)
        h, _ = self.attn(h, h, h, need_weights=False)  # one tensor as query, key and value: the packed projection
        return self.post(h)


def test_a_rerun_gets_one_tensor_where_the_forward_got_one_tensor_twice():
    """``nn.MultiheadAttention`` takes its packed path when query, key and value are one tensor: a re-run given three
    rebuilt copies would take the other path (and save other tensors); it gets one, and the gradients are exact."""
    from bagualu2.mitigation import greedy

    torch.manual_seed(0)
    model, x = SelfAttention(), torch.randn(2, 8, H, requires_grad=True)

    def step(executor):
        model.zero_grad(set_to_none=True)
        x.grad = None
        if executor is None:
            model(x).pow(2).mean().backward()
            return None, [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
        with executor.micro_batch("mb") as record:
            loss = model(x).pow(2).mean()  # the traced loss, inside the block
        loss.backward()
        executor.release("mb")
        return record, [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]

    _, plain = step(None)
    instrumented = instrument(model, {"pre": "qkv", "attn": "core_attn", "post": "attn_out"})
    graph = instrumented.trace_graph(x, hardware=CPU, loss=lambda out: out.pow(2).mean())
    plan = greedy.solve(graph, graph.unmitigated_bytes // 2).plan
    assert evaluate(graph, plan).num_recomputed_ops > 0
    record, grads = step(apply_plan(instrumented, plan, verify=True))
    assert record.device_bytes == evaluate(graph, plan).activation_bytes
    assert all(torch.equal(a, b) for a, b in zip(grads, plain))


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x):
        return torch.sigmoid(self.lin1(x)), torch.tanh(self.lin2(x))


class FrozenLater(nn.Module):
    def __init__(self):
        super().__init__()
        self.p, self.c, self.d, self.e = nn.Linear(H, H), TwoHeads(), nn.Linear(H, H), nn.Linear(H, H)

    def forward(self, x):
        s, w = self.c(self.p(x))
        return self.d(s) + self.e(w)


def test_a_saving_that_moved_to_another_slot_is_never_named_as_the_ops_own_output():
    """Freezing a part after the trace removes a saving of the call, so its input meets the slot of a tensor the call
    made: it is kept unnamed (the micro-batch warns), never regenerated as that output, and the gradients are
    exact."""
    torch.manual_seed(0)
    model, x = FrozenLater(), torch.randn(2, 8, H)
    instrumented = instrument(model, {"p": "p", "c": "c", "d": "d", "e": "e"})
    graph = instrumented.trace_graph(x, hardware=CPU, loss=lambda out: out.pow(2).mean())
    model.c.lin1.requires_grad_(False)
    plan = ",".join(f"{op.name}/{save.tensor}=RECOMPUTE" for op in graph.ops for save in op.saves
                    if graph.tensors[save.tensor].producer == "c")  # what re-running c regenerates
    assert plan
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    plain = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    executor = apply_plan(instrumented, plan)
    with pytest.warns(UntracedSavingsWarning):
        with executor.micro_batch("mb"):
            loss = model(x).pow(2).mean()
    loss.backward()
    executor.release("mb")
    assert all(torch.equal(a, p.grad) for a, p in zip(plain, [p for p in model.parameters() if p.grad is not None]))


def test_the_traced_graph_without_fp8_is_still_the_traced_graph_for_apply_plan():
    """``apply_plan(..., graph=dataclasses.replace(traced, quantize=False))`` names savings by their traced slots and
    checks the plan as ``apply_plan`` on the traced graph does: a plan that regenerates a graph input is refused."""
    import dataclasses

    torch.manual_seed(0)
    model, x = FrozenLater(), torch.randn(2, 8, H)
    instrumented = instrument(model, {"p": "p", "c": "c", "d": "d", "e": "e"})
    graph = instrumented.trace_graph(x, hardware=CPU, loss=lambda out: out.pow(2).mean())
    exact = dataclasses.replace(graph, quantize=False)
    for target in (None, exact):
        with pytest.raises(ValueError, match="p.in0"):
            apply_plan(instrumented, "p/p.in0=RECOMPUTE", graph=target)
    plan = ",".join(f"{op.name}/{save.tensor}=RECOMPUTE" for op in exact.ops for save in op.saves
                    if save.tensor == "c.out0")  # regenerated by re-running c
    executor = apply_plan(instrumented, plan, graph=exact)
    with executor.micro_batch("mb") as record:
        loss = model(x).pow(2).mean()
    loss.backward()
    executor.release("mb")
    assert evaluate(exact, plan).num_recomputed_ops == 1
    assert record.device_bytes == evaluate(exact, plan).activation_bytes


class ReplacesItsBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(H, H)
        self.register_buffer("ema", torch.zeros(H))

    def forward(self, x):
        y = self.fc(x)
        self.ema = 0.9 * self.ema + 0.1 * y.detach().mean((0, 1))  # a new tensor: the old buffer's storage is freed
        return torch.tanh(y)


def test_an_activation_at_the_address_of_a_replaced_buffer_is_counted():
    """Weights are told by their storages: once a forward replaced a buffer, the allocator may place an activation
    where the old one was; it is counted and planned like any other, in the trace and in every micro-batch."""
    from bagualu2.exec import ActivationTracker

    torch.manual_seed(0)
    model = nn.Sequential(ReplacesItsBuffer(), nn.Linear(H, H))
    x = torch.randn(2, 8, H, requires_grad=True)
    instrumented = instrument(model, {"0": "a", "1": "b"})
    graph = instrumented.trace_graph(x, hardware=CPU, loss=lambda out: out.pow(2).mean())
    tracker = ActivationTracker(exclude=[model])
    for index in range(40):  # the allocator reuses a freed address often, not always: many forwards
        with tracker.micro_batch(index):
            model(x).pow(2).mean()
        assert tracker.release(index) == graph.unmitigated_bytes
    plan = "L1.b/L0.a.out0=OFFLOAD"
    cost = evaluate(graph, plan)
    for _ in range(40):
        executor = apply_plan(instrumented, plan)
        with executor.micro_batch("mb") as record:
            loss = model(x).pow(2).mean()
        loss.backward()
        executor.release("mb")
        assert (record.device_bytes, record.host_bytes) == (cost.activation_bytes, cost.host_bytes)
