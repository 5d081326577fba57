"""How the model marks its ops for the executor: :func:`run_op`, :class:`op_scope`, :func:`after_gate` and
:func:`routed`.

All three are plain calls unless a :class:`~bagualu2.exec.apply.PlanExecutor` is recording a micro-batch in the
current context; then ``run_op`` names the op for the pack hook, lets the dual-batch executor gate it, turns ops of
the plan's re-run closure into replays, and ``after_gate`` consults the deferred planner.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Callable, Iterator, NamedTuple

import torch

from .scope import REPLAYING, ROUTED
from .tracker import storage_key

#: The cost-model op running now (set by :class:`op_scope`, read by the pack hook).
OP_SCOPE: ContextVar[str | None] = ContextVar("bagualu2_op_scope", default=None)
#: Names the current op gives to some of its inputs' storages (``{storage key: tensor name}``).
OP_HINTS: ContextVar[dict | None] = ContextVar("bagualu2_op_hints", default=None)
#: The executor and micro-batch being recorded in this context (set by ``PlanExecutor.micro_batch``).
ACTIVE: ContextVar[tuple[Any, Any] | None] = ContextVar("bagualu2_active", default=None)
#: The dual-batch executor's forward gate for a forward that records its own micro-batch (see ``DualBatchExecutor``).
FORWARD_GATE: ContextVar[Callable[[str], None] | None] = ContextVar("bagualu2_forward_gate", default=None)
#: The dual-batch worker running in this thread (forward or backward): ``park()`` ends its current stage early.
PARK: ContextVar[Callable[[], None] | None] = ContextVar("bagualu2_park", default=None)


class op_scope:
    """``with op_scope("L3.expert_fc1"): ...`` — names the cost-model op that runs inside (no-op when idle).

    ``names`` optionally maps tensors the op will save to their cost-model names: the hook uses them for storages
    it has not named yet, where size and dtype alone are ambiguous.
    """

    __slots__ = ("name", "names", "_tokens")

    def __init__(self, name: str, names: dict[str, torch.Tensor] | None = None):
        self.name = name
        self.names = names
        self._tokens = None

    def __enter__(self) -> None:
        if ACTIVE.get() is not None:  # a micro-batch records in this context (its hooks are this thread's)
            hints = ({storage_key(t): n for n, t in self.names.items()} if self.names else None)
            self._tokens = (OP_SCOPE.set(self.name), OP_HINTS.set(hints))

    def __exit__(self, *exc) -> None:
        if self._tokens is not None:
            OP_SCOPE.reset(self._tokens[0])
            OP_HINTS.reset(self._tokens[1])
            self._tokens = None


def run_op(name: str, fn: Callable[..., Any], *args: Any, names: dict[str, torch.Tensor] | None = None) -> Any:
    """Run cost-model op ``name`` as ``fn(*args)``; under a recording executor it may become a replay.

    ``fn`` must be a function of its arguments (and of parameters), deterministic in what it saves, so backward
    can re-run it. Tensor arguments are the activations the op reads (a replay reads them back from where they are
    stored, or regenerates them); other arguments, including metadata tensors passed inside a tuple, are held as
    they are.
    """
    with op_scope(name, names):
        active = ACTIVE.get()
        if active is None:
            return fn(*args)
        executor, record = active
        if record.forward_gate is not None:
            record.forward_gate(name)  # the dual-batch executor lets this op's stage run
        if name in executor.standby:  # the gate decides whether it re-runs: a replay, activated if so
            outputs = executor.replayable(record, name, fn, args, active=False)
        elif name in record.rerun:
            outputs = executor.replayable(record, name, fn, args)
        else:
            outputs = fn(*args)
        if executor.stage_hooks:
            hook_outputs(record, name, outputs)
        return outputs


def hook_outputs(record: Any, name: str, outputs: Any) -> None:
    """Gate the backward of op ``name``: a hook on its differentiable outputs runs before its backward."""
    def gate(_grad, op=name):
        if record.backward_gate is not None:
            record.backward_gate(op)

    for out in outputs if isinstance(outputs, tuple) else (outputs,):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(gate)


def after_gate(layer: int, received_tokens: int, group: Any = None, group_max_tokens: int | None = None) -> bool:
    """Called by the model after MoE layer ``layer``'s router: the routed copies this rank's experts receive.

    Returns whether the plan of the module changed (False when no deferred planner is recording). With an EP
    ``group`` the ranks must agree: if the executor knows that every rank runs the same plan and budget
    (``PlanExecutor.agreed``) and the model passes ``group_max_tokens`` (the most copies any rank of the group
    receives), every rank decides for that count, identically, without a collective; otherwise the decision is
    all-reduced (any rank changes -> all run the full downgrade), so the re-run collectives in backward match.
    """
    active = ACTIVE.get()
    if active is None:
        return False
    if active[0].deferred is None:  # a fixed plan: the count is noted (what the micro-batch keeps follows it)
        active[1].received_tokens[layer] = received_tokens
        return False
    return active[0].gate(active[1], layer, received_tokens, group, group_max_tokens)


class GateReport(NamedTuple):
    """What an instrumented model's ``gate`` callable reports after a router: ``received`` routed token copies
    this rank's experts get; optionally the expert-parallel ``group`` whose ranks must agree and the most any rank
    of it receives (``most``; see :func:`after_gate`), and ``sent``, the copies this rank's router sent (tokens x
    top-k: a rank's mean load; default ``received``). A plain ``int`` or a 3-tuple is read the same way."""

    received: int
    group: Any = None
    most: int | None = None
    sent: int | None = None


def gate_report(report: Any) -> GateReport:
    """A gate callable's return value as a :class:`GateReport` (an ``int``, a tuple, or a report); one
    ``ValueError`` naming what is wrong otherwise."""
    if not isinstance(report, GateReport):
        if isinstance(report, tuple) and 1 <= len(report) <= 4:
            report = GateReport(*report)
        else:
            report = GateReport(report)
    for name in ("received", "most", "sent"):
        value = getattr(report, name)
        if value is None and name != "received":
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"gate: the router's report must give {name} as routed token copies, an int >= 0 "
                             f"(an int, a (received, group, most, sent) tuple or an exec.GateReport), got "
                             f"{getattr(report, name)!r}")
        report = report._replace(**{name: value})
    return report


@contextlib.contextmanager
def routed() -> Iterator[None]:
    """``with routed(): ...`` around the code that makes the rows of the routed experts (gather by expert, the
    experts' GEMMs and activation, the routing weights): every tensor first seen inside holds one row per routed
    token copy this rank's experts received, so a traced graph resizes it with the imbalance
    (``costmodel.rescale``). Without it, a traced graph takes what the ``dispatch`` and expert ops make as routed."""
    token = ROUTED.set(True)
    try:
        yield
    finally:
        ROUTED.reset(token)


class _BackwardEnd(torch.autograd.Function):
    """Identity whose backward calls ``done()``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, done: Callable[[], None]) -> torch.Tensor:
        ctx.done = done
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.done()
        return grad, None


def on_backward(tensor: torch.Tensor, done: Callable[[], None]) -> torch.Tensor:
    """``tensor`` unchanged (a view), with ``done()`` called once autograd has computed its gradient: put at the
    input of a model part, it reports the end of that part's backward (its activations can be released). A tensor
    that needs no grad is returned as is (nothing to report)."""
    if not callable(done):
        raise ValueError(f"done must be a callable, got {type(done).__name__}")
    if not tensor.requires_grad:
        return tensor
    return _BackwardEnd.apply(tensor, done)


def overlap_point() -> None:
    """Called by an op right after it issued a collective that completes on its own (an ``async_op=True``
    all-to-all), before it waits for it: inside a fused scheduling point of the dual-batch executor, the op's
    stage is then done issuing, and the worker pauses as at the gate of its next stage while the order's next
    stage — the other micro-batch's compute — runs; the op waits for its collective when the worker is let through
    again. A plain call outside a fused point (and inside a re-run in backward)."""
    park = PARK.get()
    if park is not None and not REPLAYING.get():
        park()
