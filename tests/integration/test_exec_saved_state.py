"""What a plan's savings are read back from: a retained graph's second backward, a saving changed in place after
its forward (PyTorch's own check, which saved-tensor hooks turn off), a forward hook added after ``instrument``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bagualu2.costmodel import evaluate, presets
from bagualu2.exec import ActivationTracker, apply_plan, instrument

CPU = presets.hardware("cpu")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.act = nn.Linear(8, 8), nn.GELU()

    def forward(self, x):
        a = self.proj(x)
        return self.act(a) * a  # GELU saves a; the product, outside every op, keeps it too


class Net(nn.Module):
    def __init__(self, num_layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList([Block() for _ in range(num_layers)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _loss(out):
    return out.pow(2).mean()


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model, x = Net(), torch.randn(4, 8, requires_grad=True)
    instrumented = instrument(model, {"layers.*.proj": "proj", "layers.*.act": "act"})
    graph = instrumented.trace_graph(x, hardware=CPU, loss=_loss)
    return model, x, instrumented, graph


def _grads(model, x, loss, **kwargs):
    return torch.autograd.grad(loss, [x, *model.parameters()], **kwargs)


@pytest.mark.parametrize("plan", ["L0.act/L0.proj.out0=RECOMPUTE", "L1.act/L1.proj.out0=RECOMPUTE",
                                  "L0.act/L0.proj.out0=OFFLOAD,L1.act/L1.proj.out0=RECOMPUTE",
                                  "L0.act/L0.proj.out0=RECOMPUTE,L1.act/L1.proj.out0=OFFLOAD"])
def test_a_retained_graph_gives_the_same_gradients_on_its_second_backward(plan):
    """The second backward of a retained graph reads what the first regenerated, also where the copy the first
    read (the product's kept alias) is freed by the second before the RECOMPUTE saving is unpacked."""
    model, x, instrumented, graph = _setup()
    plain = _grads(model, x, _loss(model(x)))
    executor = apply_plan(instrumented, plan)
    with executor.micro_batch("mb") as record:
        loss = _loss(model(x))
    assert record.device_bytes == evaluate(graph, plan).activation_bytes
    first = _grads(model, x, loss, retain_graph=True)
    second = _grads(model, x, loss)
    executor.release("mb")
    for reference, a, b in zip(plain, first, second):
        assert torch.equal(a, reference) and torch.equal(b, reference)


class Mlp(nn.Module):
    def __init__(self, act: nn.Module, *, change_saved: bool = False):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(8, 16), act, nn.Linear(16, 8)
        self.change_saved = change_saved

    def forward(self, x):
        a = self.act(self.fc1(x))  # tanh saves its output, GELU its input; fc2 saves a as its input
        y = self.fc2(a)
        if self.change_saved:
            a.mul_(0.5)  # a bug of the model's: a saved tensor changes before the backward
        return x + y


def _mlp(act: nn.Module, *, change_saved: bool = False):
    torch.manual_seed(0)
    model, x = Net(0), torch.randn(4, 8, requires_grad=True)
    model.layers.append(Mlp(act, change_saved=change_saved))
    return model, x


@pytest.mark.parametrize("plan", [None, "L0.fc2/L0.act.out0=OFFLOAD", "L0.fc2/L0.act.out0=RECOMPUTE", "tracker"])
def test_a_saving_changed_in_place_after_its_forward_is_refused_as_pytorch_refuses_it(plan):
    model, x = _mlp(nn.Tanh(), change_saved=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _loss(model(x)).backward()  # plain PyTorch
    if plan == "tracker":
        tracker = ActivationTracker(exclude=[model])
        with tracker.micro_batch("mb"):
            loss = _loss(model(x))
    else:
        instrumented = instrument(model, {"layers.*.fc1": "fc1", "layers.*.act": "act", "layers.*.fc2": "fc2"})
        model.layers[0].change_saved = False  # the trace runs a backward
        instrumented.trace_graph(x, hardware=CPU, loss=_loss)
        model.layers[0].change_saved = True
        executor = apply_plan(instrumented, plan)
        with executor.micro_batch("mb"):
            loss = _loss(model(x))
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: a \(4, 16\) torch.float32 tensor"):
        loss.backward()


# the pre-hook's product is a storage the traced forward did not save: warned, and kept
@pytest.mark.filterwarnings("ignore::bagualu2.exec.instrument.UntracedSavingsWarning")
def test_a_forward_hook_added_after_instrument_is_refused_where_the_plan_re_runs_the_module():
    """A re-run calls the module's forward: a pre-hook that runs after the op's own (registered after
    ``instrument``), or a forward hook before it, would make the forward's values differ from the re-run's, so
    such a plan stops in one line; where nothing is re-run the hook runs as in the plain model."""
    model, x = _mlp(nn.GELU())  # GELU saves its input: fc2's saving of its output is regenerated by re-running it
    instrumented = instrument(model, {"layers.*.fc1": "fc1", "layers.*.act": "act", "layers.*.fc2": "fc2"})
    instrumented.trace_graph(x, hardware=CPU, loss=_loss)
    act = model.layers[0].act
    for hook in (lambda: act.register_forward_pre_hook(lambda module, args: (args[0] * 2,)),
                 lambda: act.register_forward_hook(lambda module, args, out: out * 2, prepend=True)):
        handle = hook()
        plain = _grads(model, x, _loss(model(x)))
        kept = apply_plan(instrumented, "L0.fc2/L0.act.out0=OFFLOAD")
        with kept.micro_batch("mb"):
            loss = _loss(model(x))
        assert all(torch.equal(a, b) for a, b in zip(_grads(model, x, loss), plain))
        kept.release("mb")
        executor = apply_plan(instrumented, "L0.fc2/L0.act.out0=RECOMPUTE")
        with pytest.raises(ValueError, match=r"re-runs L0.act \(module layers.0.act\), which got a forward hook "
                                             r"after instrument\(\)"):
            with executor.micro_batch("mb"):
                model(x)
        handle.remove()
        with executor.micro_batch("mb"):  # the hook gone, the same plan runs
            loss = _loss(model(x))
        assert all(torch.equal(a, b) for a, b in zip(_grads(model, x, loss), _grads(model, x, _loss(model(x)))))
        executor.release("mb")


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_forward_without_gradients_runs_under_a_plan_that_re_runs_ops(mode):
    """Nothing is saved without gradients, so nothing is re-run: the forward's output is the plain model's, and the
    same executor then trains as before."""
    model, x = _mlp(nn.GELU())
    instrumented = instrument(model, {"layers.*.fc1": "fc1", "layers.*.act": "act", "layers.*.fc2": "fc2"})
    instrumented.trace_graph(x, hardware=CPU, loss=_loss)
    plan = "L0.act/L0.fc1.out0=RECOMPUTE,L0.fc2/L0.act.out0=RECOMPUTE"
    executor = apply_plan(instrumented, plan)
    with mode():
        plain = model(x)
        with executor.micro_batch("eval") as record:
            out = model(x)
    assert torch.equal(out, plain) and record.device_bytes == 0
    executor.release("eval")
    with executor.micro_batch("train"):
        loss = _loss(model(x))
    assert all(torch.equal(a, b) for a, b in zip(_grads(model, x, loss), _grads(model, x, _loss(model(x)))))


class Drops(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = nn.Linear(16, 16), nn.Tanh()

    def forward(self, x):
        h = self.fc(x)
        for _ in range(3):
            torch.exp(h)  # computed with gradients and dropped: its saved output is freed in the forward
        return self.act(h)


def test_savings_freed_in_the_forward_are_counted_alike_by_the_trace_the_executor_and_the_tracker():
    """A storage freed in the forward whose address a later saving takes is two storages to the tracker, as to the
    trace and the executor (all three count the freed one as kept: a documented limit)."""
    torch.manual_seed(0)
    model, x = Drops(), torch.randn(8, 16)
    instrumented = instrument(model, {"fc": "fc", "act": "act"})
    graph = instrumented.trace_graph(x, hardware=CPU)
    tracker = ActivationTracker(exclude=[model])
    with tracker.micro_batch("tracked"):
        model(x)
    executor = apply_plan(instrumented, None)
    with executor.micro_batch("planned") as record:
        model(x)
    assert graph.unmitigated_bytes == tracker.kept_bytes("tracked") == record.device_bytes == 5 * 8 * 16 * 4
