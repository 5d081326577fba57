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
from typing import Any, Callable, Mapping, NamedTuple

from ..budget import BudgetAssigner, BudgetPhase
from ..costmodel.validate import require_int
from .stage import Stage, Step

WARMUP = BudgetPhase.WARMUP.value
PHASES = (WARMUP, BudgetPhase.STEADY.value)  # the phases a forward runs in


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
    in-flight bytes are followed. Budgeted, the bookkeeping is Algorithm 1's (:class:`BudgetAssigner`): its
    ``next_forward``, ``record_forward`` and ``record_backward`` are this iteration's."""

    def __init__(self, stage: Stage, *, m_max_bytes: int | None = None, budgeted: bool = True):
        if not isinstance(stage, Stage):
            raise ValueError(f"stage must be a runtime Stage (the stage engine), got {type(stage).__name__}")
        if not isinstance(budgeted, bool):
            raise ValueError(f"budgeted must be True or False, got {budgeted!r}")
        memory = stage.memory
        self.m_max_bytes = memory.m_max_bytes if m_max_bytes is None else require_int("m_max_bytes", m_max_bytes, 1)
        self.m0_bytes = memory.m0_bytes
        self.assigner = (BudgetAssigner(m_max_bytes=self.m_max_bytes, m0_bytes=memory.m0_bytes,
                                        num_microbatches=stage.num_forwards, num_warmup=memory.inflight_chunks)
                         if budgeted else None)
        if self.assigner is not None:  # the hot path calls the assigner's methods directly
            self.next_forward = self.assigner.next_forward
            self.record_forward = self.assigner.record_forward
            self.record_backward = self.assigner.record_backward
        self._num_forwards = stage.num_forwards
        self._kept: dict[int, int] = {}  # forward index -> bytes it keeps (recorded this iteration)
        self._in_flight: dict[int, int] = {}  # the recorded forwards whose backward has not run
        self._held_bytes = self._peak_bytes = 0

    @property
    def held_bytes(self) -> int:
        """The in-flight bytes: kept by forwards whose backward has not run."""
        return self._held_bytes if self.assigner is None else self.assigner.in_flight_bytes

    @property
    def peak_bytes(self) -> int:
        """The most in-flight bytes after any forward."""
        return self._peak_bytes if self.assigner is None else self.assigner.peak_in_flight_bytes

    def budget(self, phase: str) -> tuple[int, int | None]:
        """``(budget, limit)`` of the next forward: Algorithm 1's budget and, in warmup, the most an overrun may
        keep (``BudgetAssigner.absorb_limit_bytes``; None in the steady phase). ``(0, None)`` unbudgeted.
        ``phase``: ``"warmup"``, ``"steady"`` or a :class:`~bagualu2.budget.BudgetPhase`."""
        phase = getattr(phase, "value", phase)
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)} (or a BudgetPhase), got {phase!r}")
        assigner = self.assigner
        if assigner is None:
            return 0, None
        return assigner.next_forward_budget(), assigner.absorb_limit_bytes() if phase == WARMUP else None

    def next_forward(self) -> tuple[int, int | None]:
        """:meth:`budget` of the next forward, its phase the assigner's (forwards recorded in schedule order: a
        step's ``phase`` is the same)."""
        return 0, None

    def record_forward(self, index: int, kept_bytes: int) -> int:
        """Forward ``index`` keeps ``kept_bytes``; returns the in-flight bytes after it. ``ValueError`` for an index
        not in ``[0, num_forwards)`` or already recorded, or bytes that are not an integer >= 0."""
        if type(index) is not int or not 0 <= index < self._num_forwards:
            index = require_int("record_forward: index", index, 0, self._num_forwards)
        if type(kept_bytes) is not int or kept_bytes < 0:
            kept_bytes = require_int("kept_bytes", kept_bytes, 0)
        if index in self._kept:
            raise ValueError(f"record_forward: index={index} was already recorded in this iteration")
        held = self._held_bytes = self._held_bytes + kept_bytes
        self._kept[index] = self._in_flight[index] = kept_bytes
        if held > self._peak_bytes:
            self._peak_bytes = held
        return held

    def record_backward(self, index: int) -> None:
        """The backward of forward ``index`` ran: its bytes are free (``ValueError`` unless it is in flight)."""
        freed = self._in_flight.pop(index, None) if type(index) is int else None
        if freed is None:
            index = require_int("record_backward: index", index, 0, self._num_forwards)
            raise ValueError(f"record_backward: index={index} is not in flight; allowed: one of "
                             f"{sorted(self._in_flight)}")
        self._held_bytes -= freed


def is_sequence(values) -> bool:
    """A list, a tuple, a numpy array...: indexable with a length; not text and not a mapping."""
    return (not isinstance(values, (str, bytes, Mapping)) and hasattr(values, "__len__")
            and hasattr(values, "__getitem__"))


def run_iteration(stage: Stage, decide: Callable[[Step, float, int, int | None], Any], imbalances, *,
                  m_max_bytes: int | None = None, budgeted: bool = True) -> IterationRun:
    """Run one iteration of ``stage``: for every forward ``decide(step, imbalance, budget_bytes, limit_bytes)``
    returns what the forward runs (anything with ``kept_bytes``), ``imbalances[m]`` being micro-batch m's
    measured rate; see :class:`Iteration` for ``m_max_bytes`` and ``budgeted``."""
    if not isinstance(stage, Stage):
        raise ValueError(f"stage must be a runtime Stage (the stage engine), got {type(stage).__name__}")
    if not callable(decide):
        raise ValueError(f"decide must be a callable (step, imbalance, budget_bytes, limit_bytes), got "
                         f"{type(decide).__name__}")
    if not is_sequence(imbalances):
        raise ValueError(f"imbalances must be a sequence of rates (one per micro-batch), got "
                         f"{type(imbalances).__name__}")
    if len(imbalances) != stage.parallel.num_microbatches:
        raise ValueError(f"imbalances must have num_microbatches={stage.parallel.num_microbatches} entries, "
                         f"got {len(imbalances)}")
    iteration = Iteration(stage, m_max_bytes=m_max_bytes, budgeted=budgeted)
    next_forward, record_forward, record_backward = (iteration.next_forward, iteration.record_forward,
                                                     iteration.record_backward)
    raw = []
    keep = raw.append
    started = time.perf_counter()
    result = missing = object()  # what no decide returned yet
    try:
        for step in stage.steps:  # the timed hot path: budget, decision, re-basing
            if not step.forward:
                record_backward(step.index)
                continue
            budget_bytes, limit_bytes = next_forward()
            imbalance = imbalances[step.microbatch]
            result = decide(step, imbalance, budget_bytes, limit_bytes)
            keep((step, imbalance, budget_bytes, result, record_forward(step.index, result.kept_bytes)))
    except AttributeError:
        if result is not missing and not hasattr(result, "kept_bytes"):
            raise ValueError(f"decide must return what the forward runs, with kept_bytes; got "
                             f"{type(result).__name__}") from None
        raise
    elapsed = time.perf_counter() - started
    return IterationRun(tuple(Forward._make(row) for row in raw), iteration.m_max_bytes, iteration.m0_bytes,
                        iteration.peak_bytes, elapsed)
