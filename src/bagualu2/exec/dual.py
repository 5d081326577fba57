"""Run one fused scheduling point F_x B_y (paper §V-B) in the order a fusion solver chose.

The four chains of ``bagualu2.fusion.build_chains`` are executed stage by stage, in the groups of an
:class:`~bagualu2.fusion.Order`:

* ``F`` stage k: the forward ops of micro-batch x in that stage. The forward runs in a worker thread, inside the
  executor's ``micro_batch(x)``; the instrument's pre-hook (or :func:`~bagualu2.exec.ops.run_op`) calls the gate
  before each op, which blocks until
  the op's stage is let through.
* ``B`` stage k: the backward of micro-batch y through the ops of that stage. ``loss.backward()`` runs in a second
  worker thread; a hook on every differentiable output of every op of y (registered during y's forward, so the
  executor needs ``stage_hooks`` on from then) runs right before that op's backward and blocks the same way, so
  backward proceeds stage by stage through the autograd graph.
* ``O`` stage: the device->host copies of micro-batch x-1's offloaded tensors (``offload_now``; offloads are
  deferred while ``defer_offloads`` is on).
* ``R`` stage: the recovery of micro-batch y+1: reloads of its host copies and early re-runs of its replays
  (``recover``); dequantisation happens on unpack.

A stage is done when its worker blocks at a gate of a later stage or finishes. An error in any stage ends the
point at once: the scheduler issues no further stage, and the other worker, parked at a gate, is released with
:class:`PointAborted` raised from that gate, so it runs no further op (and issues no further collective) before the
error reaches the caller. Under expert parallelism this keeps every rank of a group on one collective order: the
order is agreed, so a rank either follows it or stops; it never runs ahead into another stage's collectives.

Stages of one barrier group are issued one after the other (one worker at a time), so any order that keeps the chain
orders computes exactly what sequential execution computes. An op that issues an asynchronous collective (the
reference model's all-to-alls: ``async_op=True``) calls :func:`~bagualu2.exec.ops.overlap_point` before waiting for
it: its worker pauses as at the gate of its next stage (:meth:`_Worker.park`), so the scheduler issues the order's
next stage — the other micro-batch's compute — while the collective is in flight, and the op waits for it when its
worker is let through again. The collectives are issued in the order's sequence on every rank, as before. On CPU
gloo runs the exchange on its own threads beside that compute; on CUDA the issue is asynchronous: the O and R
copies run on the copy engine's side streams and overlap the compute issued next, and NCCL all-to-alls run on
NCCL's stream (``work.wait()`` orders the current stream after it). Forward and backward compute kernels are
issued on the streams autograd assigns (a backward op runs on its forward op's stream); a second compute stream for
alternate micro-batches (F_x and B_y compute overlapping each other) is not implemented — it needs cross-stream
allocator bookkeeping that can only be validated on a GPU.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from bagualu2.fusion import Chains, Order

from .apply import PlanExecutor
from .ops import FORWARD_GATE, PARK


class PointAborted(RuntimeError):
    """Raised inside a worker released after another stage of its scheduling point failed."""


class _Worker:
    """A thread that runs ``work`` and pauses at the gates of ops whose stage has not been let through yet."""

    def __init__(self, kind: str, stage_of: dict[str, int], trace: list, work: Callable[[], Any] | None = None):
        self.kind, self.trace = kind, trace
        self.stage_of = stage_of
        self.work = work
        self.started = False
        self.cond = threading.Condition()
        self.allowed = -1
        self.aborted = False
        self.waiting: int | None = None
        self.done = False
        self.current = -1  # the stage of the last op let through
        self.result: Any = None
        self.error: BaseException | None = None
        self.ops: list[str] = []  # ops in the order they were let through
        self.thread = threading.Thread(target=self._main, name=f"bagualu2-{kind}", daemon=True)

    def _main(self) -> None:
        try:
            self.result = self.work()
        except BaseException as exc:  # re-raised by the scheduler
            self.error = exc
        finally:
            with self.cond:
                self.done = True
                self.cond.notify_all()

    def gate(self, op: str) -> None:
        stage = self.stage_of.get(op)
        with self.cond:
            self._hold(stage, f"before {op}")
            if stage is not None:
                self.current = max(self.current, stage)
            self.ops.append(op)
            self.trace.append((self.kind, op))

    def park(self) -> None:
        """The running op issued an asynchronous collective: its stage is done issuing. Pause as at a gate of the
        next stage (``exec.ops.overlap_point``), so the scheduler runs the order's next stage meanwhile."""
        stage = self.current + 1
        with self.cond:
            self.trace.append((self.kind, f"park:{stage - 1}"))
            self._hold(stage, f"in stage {stage - 1}")

    def _hold(self, stage: int | None, where: str) -> None:
        """(Under the lock.) Wait until ``stage`` is let through; raise :class:`PointAborted` once aborted."""
        if stage is not None and stage > self.allowed:
            self.waiting = stage
            self.cond.notify_all()
            self.cond.wait_for(lambda: stage <= self.allowed or self.aborted)
            self.waiting = None
        if self.aborted:
            raise PointAborted(f"{self.kind} stopped {where}: another stage of the point failed")

    def run_through(self, stage: int) -> None:
        """Let stages up to ``stage`` run; return when the worker is past them (or finished)."""
        with self.cond:
            if not self.started:
                self.started = True
                self.thread.start()
            self.allowed = max(self.allowed, stage)
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.done or (self.waiting is not None and self.waiting > stage))

    def abort(self) -> None:
        """Stop at the next gate (raising :class:`PointAborted` there) and wait for the thread to end."""
        with self.cond:
            self.aborted = True
            self.cond.notify_all()
        if self.started:
            self.thread.join()

    def finish(self):
        self.run_through(1 << 30)
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.result


def _stage_index(chain) -> dict[str, int]:
    """``{op name: stage number}`` of a chain, by the names the gates see: a backward chain's ``<op>.bwd`` is gated
    as ``<op>`` (the hook on the op's outputs runs right before its backward)."""
    index: dict[str, int] = {}
    if chain is not None:
        for number, stage in enumerate(chain.stages):
            for op in stage.ops:
                index.setdefault(op.removesuffix(".bwd"), number)
    return index


@dataclass
class PointResult:
    """What a scheduling point ran: the forward's result, the stages in execution order, the ops each worker
    let through (program order for F, backward order for B)."""

    forward: Any = None
    stages: list[str] = field(default_factory=list)
    trace: list[tuple[str, str]] = field(default_factory=list)  # (F or B, op) as both workers passed their gates
    forward_ops: list[str] = field(default_factory=list)
    backward_ops: list[str] = field(default_factory=list)


class DualBatchExecutor:
    """Executes scheduling points of micro-batches recorded by ``executors`` (see the module docstring).

    Several executors (one per virtual chunk of a pipeline stage, say) may share one dual-batch executor: each
    micro-batch is found in the executor that records it."""

    def __init__(self, executor: PlanExecutor, *others: PlanExecutor):
        self.executor = executor
        self.executors = (executor, *others)
        for each in self.executors:
            each.stage_hooks = True
            each.defer_offloads = True

    def owner(self, name: str) -> PlanExecutor:
        """The executor recording micro-batch ``name``."""
        for each in self.executors:
            if name in each:
                return each
        raise ValueError(f"micro-batch {name!r} is not in flight in any executor")

    def run(self, order: Order, chains: Chains, *,
            forward: tuple[str, Callable[[], Any]] | Callable[[], Any] | None = None,
            backward: tuple[str, torch.Tensor | Callable[[], Any]] | None = None, offload: str | None = None,
            recovery: str | None = None) -> PointResult:
        """Run ``order`` on ``chains``: ``forward = (x, fn)`` runs ``fn()`` as the forward of micro-batch x,
        recorded by the first executor; a bare ``forward = fn`` records its micro-batch itself (it opens
        ``micro_batch`` of the right executor; the gate reaches it through ``FORWARD_GATE``);
        ``backward = (y, loss)`` runs ``loss.backward()`` (or ``loss()`` if callable) for micro-batch y;
        ``offload`` names x-1 and ``recovery`` y+1. A chain of ``chains`` needs its micro-batch and vice versa."""
        self._check(order, chains, forward, backward, offload, recovery)
        executor = self.executor
        result = PointResult()
        workers: dict[str, _Worker] = {}
        if forward is not None:
            workers["F"] = worker = _Worker("F", _stage_index(chains.forward), result.trace)
            if callable(forward):
                def run_forward(fn=forward, worker=worker):
                    FORWARD_GATE.set(worker.gate)  # the worker thread's own context
                    PARK.set(worker.park)
                    return fn()
            else:
                name, fn = forward

                def run_forward(fn=fn, name=name, worker=worker):
                    PARK.set(worker.park)
                    with executor.micro_batch(name) as record:
                        record.forward_gate = worker.gate
                        try:
                            return fn()
                        finally:
                            record.forward_gate = None

            worker.work = run_forward
        backward_record = None
        if backward is not None:
            name, loss = backward
            backward_record = self.owner(name).record(name)
            work = loss if callable(loss) else loss.backward
            workers["B"] = worker = _Worker("B", _stage_index(chains.backward), result.trace)

            def run_backward(work=work, worker=worker):
                PARK.set(worker.park)  # the CPU backward runs in this thread: its collectives can park it
                return work()

            worker.work = run_backward
            backward_record.backward_gate = worker.gate
        try:
            for group in order.groups:
                for kind, index in group:
                    result.stages.append(f"{kind}{index}")
                    stage = chains.get(kind).stages[index]
                    if kind in workers:
                        workers[kind].run_through(index)
                        if workers[kind].error is not None:  # stop here: no later stage, no later collective
                            raise workers[kind].error
                    elif kind == "O":
                        self.owner(offload).offload_now(offload, {op.split(":")[1] for op in stage.ops})
                    else:
                        self.owner(recovery).recover(
                            recovery, tensors={op.split(":")[1] for op in stage.ops if op.startswith("h2d:")},
                            ops={op[:-3] for op in stage.ops if op.endswith(".re")})
            for kind, worker in workers.items():
                value = worker.finish()
                if kind == "F":
                    result.forward, result.forward_ops = value, worker.ops
                else:
                    result.backward_ops = worker.ops
        finally:
            if backward_record is not None:
                backward_record.backward_gate = None
            for worker in workers.values():  # an error: the others stop at their next gate, running nothing more
                if worker.started and worker.thread.is_alive():
                    worker.abort()
        return result

    @staticmethod
    def _check(order, chains, forward, backward, offload, recovery) -> None:
        given = {"F": forward, "B": backward, "O": offload, "R": recovery}
        for kind, value in given.items():
            chain = chains.get(kind)
            if chain is not None and value is None:
                raise ValueError(f"chain {kind} has stages but no micro-batch was given for it")
        seen: dict[str, int] = {}
        for group in order.groups:
            for kind, index in group:
                chain = chains.get(kind)
                if chain is None or index >= len(chain):
                    raise ValueError(f"order stage {kind}{index} is not a stage of these chains")
                if index != seen.get(kind, -1) + 1:
                    raise ValueError(f"order runs {kind}{index} out of its chain's order")
                seen[kind] = index
        for chain in chains.present():
            if seen.get(chain.kind, -1) != len(chain) - 1:
                raise ValueError(f"order does not run every stage of chain {chain.kind}")
