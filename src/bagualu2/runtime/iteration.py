"""The one iteration driver of a stage: its steps in schedule order, Algorithm 1's budget for every forward, the
bytes each forward keeps recorded back into the budget (re-basing), every backward freeing its forward's bytes.

:func:`run_iteration` runs a whole iteration for a decision function — the runtime replay (``replay_iteration``)
and the simulator's policies are such functions. A caller whose own schedule runs the steps (the reference
trainer, under ``torch.distributed.pipelining``) drives an :class:`Iteration` step by step instead and records
the bytes it measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

from ..budget import BudgetAssigner
from ..costmodel.validate import require_int
from .stage import Stage, Step

WARMUP = "warmup"


class Forward(NamedTuple):
    """One chunk-forward of an iteration: its step, the imbalance its gate measured, its budget (0 unbudgeted),
    what the decision function returned for it, and the in-flight bytes after it."""

    step: Step
    imbalance: float
    budget_bytes: int
    result: Any
    held_bytes: int


@dataclass(frozen=True)
class IterationRun:
    forwards: tuple[Forward, ...]
    m_max_bytes: int
    m0_bytes: int
    peak_bytes: int     # the most in-flight bytes after any forward
    elapsed_s: float    # wall time of the loop: budgets, decisions, records

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.m_max_bytes


class Iteration:
    """One iteration of ``stage`` driven step by step: :meth:`budget` before a forward, :meth:`record_forward`
    with the bytes it keeps after it, :meth:`record_backward` after its backward. ``m_max_bytes`` (default the
    stage's ``M_max``) is the activation capacity the budgets share; ``budgeted=False``: no budgets (0), only the
    in-flight bytes are followed."""

    def __init__(self, stage: Stage, *, m_max_bytes: int | None = None, budgeted: bool = True):
        memory = stage.memory
        self.m_max_bytes = memory.m_max_bytes if m_max_bytes is None else require_int("m_max_bytes", m_max_bytes, 1)
        self.m0_bytes = memory.m0_bytes
        self.assigner = (BudgetAssigner(m_max_bytes=self.m_max_bytes, m0_bytes=memory.m0_bytes,
                                        num_microbatches=stage.num_forwards, num_warmup=memory.inflight_chunks)
                         if budgeted else None)
        self._kept = [0] * stage.num_forwards
        self.held_bytes = self.peak_bytes = 0

    def budget(self, phase: str) -> tuple[int, int | None]:
        """``(budget, limit)`` of the next forward: Algorithm 1's budget and, in warmup, the most an overrun may
        keep (``BudgetAssigner.absorb_limit_bytes``; None in the steady phase). ``(0, None)`` unbudgeted."""
        assigner = self.assigner
        if assigner is None:
            return 0, None
        return assigner.next_forward_budget(), assigner.absorb_limit_bytes() if phase == WARMUP else None

    def record_forward(self, index: int, kept_bytes: int) -> int:
        """Forward ``index`` keeps ``kept_bytes``; returns the in-flight bytes after it."""
        if self.assigner is not None:
            held = self.assigner.record_forward(index, kept_bytes)
        else:
            held = self.held_bytes + kept_bytes
        self._kept[index] = kept_bytes
        self.held_bytes = held
        if held > self.peak_bytes:
            self.peak_bytes = held
        return held

    def record_backward(self, index: int) -> None:
        """The backward of forward ``index`` ran: its bytes are free."""
        if self.assigner is not None:
            self.assigner.record_backward(index)
        self.held_bytes -= self._kept[index]


def run_iteration(stage: Stage, decide: Callable[[Step, float, int, int | None], Any], imbalances, *,
                  m_max_bytes: int | None = None, budgeted: bool = True) -> IterationRun:
    """Run one iteration of ``stage``: for every forward ``decide(step, imbalance, budget_bytes, limit_bytes)``
    returns what the forward runs (anything with ``kept_bytes``), ``imbalances[m]`` being micro-batch m's
    measured rate; see :class:`Iteration` for ``m_max_bytes`` and ``budgeted``."""
    if len(imbalances) != stage.parallel.num_microbatches:
        raise ValueError(f"imbalances must have num_microbatches={stage.parallel.num_microbatches} entries, "
                         f"got {len(imbalances)}")
    iteration = Iteration(stage, m_max_bytes=m_max_bytes, budgeted=budgeted)
    budget, record_forward, record_backward = iteration.budget, iteration.record_forward, iteration.record_backward
    raw = []
    keep = raw.append
    started = time.perf_counter()
    for step in stage.steps:  # the timed hot path: budget, decision, re-basing
        if not step.forward:
            record_backward(step.index)
            continue
        budget_bytes, limit_bytes = budget(step.phase)
        imbalance = imbalances[step.microbatch]
        result = decide(step, imbalance, budget_bytes, limit_bytes)
        keep((step, imbalance, budget_bytes, result, record_forward(step.index, result.kept_bytes)))
    elapsed = time.perf_counter() - started
    return IterationRun(tuple(Forward._make(row) for row in raw), iteration.m_max_bytes, iteration.m0_bytes,
                        iteration.peak_bytes, elapsed)
