"""Pipeline-aware activation-memory budget assignment (Algorithm 1 of BaGuaLu-2, §V-A).

One :class:`BudgetAssigner` lives on one pipeline stage for one training iteration. It hands out the activation
budget (in bytes) of the next forward micro-batch and is told, after each forward, how many bytes that micro-batch
*actually* keeps in flight, and, after each backward, which micro-batch released its activations. Pure stdlib: no
torch, no numpy, no I/O.

Notation (paper -> code): ``M_max`` -> ``m_max_bytes`` (bytes available for activations on this stage), ``M_0`` ->
``m0_bytes`` (floor of one micro-batch: full recompute keeps only the block input), ``B`` -> ``num_microbatches``,
``B_w`` -> ``num_warmup`` (forwards that stack before the first backward frees memory, i.e. the in-flight count of a
1F1B schedule).

Budgets
-------
Let ``in_flight`` be the *measured* bytes of the micro-batches whose forward was recorded and whose backward was not
(re-basing on actual bytes, paper lines 7 and 14), and ``launched`` the number of recorded forwards.

* Warmup (``launched < B_w``), with ``k = B_w - launched`` warmup batches not yet launched (this one included)::

      budget = (M_max - in_flight) // k  ==  M_0 + (M_max - in_flight - k * M_0) // k

  i.e. the remaining capacity split evenly over the not-yet-launched warmup batches, reserving ``M_0`` for each.
* Steady (``B_w <= launched < B``): each forward follows a backward, and all bytes not in flight go to it::

      budget = M_max - in_flight

  With ``contain_overruns`` (the default) a steady forward does not inherit an overrun: of the bytes a backward
  frees, what its micro-batch kept beyond both its own budget and an even share ``M_max // B_w`` (a warmup overrun
  absorbed, a spike that did not fit) is held back from the next forward, whose budget is then
  ``M_max - in_flight - excess``. A plan's time grows faster the tighter its budget (the cheap savings go first),
  and Algorithm 1 as printed (``contain_overruns=False``) passes such an uneven split on for the whole iteration:
  the big micro-batch's bytes go to one successor, whose own then go to the one after that, with the period of
  ``B_w``. Held back once, the split is even again after one round; without overruns the two rules are the same.

A budget is clamped at 0 when recorded overruns left ``in_flight`` above ``M_max``.

Guarantees (proof)
------------------
(1) *If every recorded forward fits the budget in force when it was recorded, in-flight bytes never exceed M_max.*
Both formulas give ``budget <= M_max - in_flight`` (warmup divides a non-negative number by ``k >= 1``), so a forward
that fits leaves ``in_flight + actual <= M_max``; backwards only lower ``in_flight``.

(2) *Warmup budgets are >= M_0.* Claim: before the warmup forward with ``k`` batches left,
``M_max - in_flight >= k * M_0``. For the first forward ``k = B_w``, ``in_flight = 0`` and construction requires
``M_max >= B_w * M_0``. Step: with ``R = M_max - in_flight >= k * M_0`` the budget is ``R // k >= M_0``, and a fitting
actual ``a <= R // k <= R / k`` leaves ``R - a >= R * (k - 1) / k >= (k - 1) * M_0`` for the next one; a backward in
between only increases ``R``.

(3) *Steady budgets are >= M_0* when each steady forward is preceded by a backward of a micro-batch whose actual
bytes were >= M_0 (true on hardware: M_0 is the full-recompute floor). By (1), ``in_flight <= M_max`` after the
previous forward; the backward frees ``a_y >= M_0`` bytes, so ``M_max - in_flight >= a_y >= M_0``. What is held
back of ``a_y`` leaves at least ``max(granted_y, M_max // B_w) >= M_0`` of it (``M_max >= B_w * M_0``).

Deferred planning (§V-A): the MoE imbalance is only known after the gate; ``bagualu2.runtime.after_gate`` decides
what the micro-batch runs then. In warmup an overrun up to :meth:`BudgetAssigner.absorb_limit_bytes` is accepted:
it is recorded as measured and later budgets shrink ("deferring provisioning to the next micro-batch"), never
below ``M_0`` (the limit leaves ``M_0`` for each later warmup forward, so invariant (2) holds again from there).
"""

from __future__ import annotations

import enum

from ..costmodel.config import PARALLEL_MAX
from ..costmodel.validate import require_int

MAX_FORWARDS = PARALLEL_MAX["num_microbatches"] * PARALLEL_MAX["vp"]  # chunk-forwards of a stage's iteration

__all__ = ["BudgetAssigner", "BudgetPhase"]


class BudgetPhase(enum.Enum):
    """Pipeline phase of the *next* forward: warmup, steady (1F1B), or done (all forwards launched; cooldown)."""

    WARMUP = "warmup"
    STEADY = "steady"
    DONE = "done"


class BudgetAssigner:
    """Algorithm 1 as a small state machine for one pipeline stage and one iteration (see the module docstring).

    Protocol per iteration: for each forward, ``next_forward_budget()`` (a read-only peek, any number of times),
    run the forward under that budget, then ``record_forward(mb, actual_bytes)``; after each backward,
    ``record_backward(mb)``. ``reset()`` starts the next iteration with the same configuration. Misuse (recording a
    micro-batch twice, out of range, backward of a micro-batch not in flight, asking for a budget after all forwards
    were launched) raises ValueError.
    """

    def __init__(self, *, m_max_bytes: int, m0_bytes: int, num_microbatches: int, num_warmup: int,
                 contain_overruns: bool = True) -> None:
        """Validate the configuration.

        Args:
            m_max_bytes: activation capacity of the stage in bytes, int >= num_warmup * m0_bytes.
            m0_bytes: floor of one micro-batch in bytes (full recompute keeps only the block input), int >= 0.
            num_microbatches: forwards in this iteration (paper ``B``), int >= 1.
            num_warmup: forwards that stack before the first backward (paper ``B_w``), int in [1, num_microbatches].
            contain_overruns: a steady forward does not inherit the overrun of the micro-batch whose backward
                freed its bytes (see the module docstring); False: all free bytes to every steady forward, as the
                paper prints Algorithm 1.
        """
        if not isinstance(contain_overruns, bool):
            raise ValueError(f"contain_overruns must be True or False, got {contain_overruns!r}")
        m_max_bytes = require_int("m_max_bytes", m_max_bytes, 0)
        m0_bytes = require_int("m0_bytes", m0_bytes, 0)
        num_microbatches = require_int("num_microbatches", num_microbatches, 1, MAX_FORWARDS, high_open=False)
        num_warmup = require_int("num_warmup", num_warmup, 1, num_microbatches, high_open=False)
        floor_bytes = num_warmup * m0_bytes
        if m_max_bytes < floor_bytes:
            raise ValueError(
                f"m_max_bytes={m_max_bytes} is below num_warmup * m0_bytes = {num_warmup} * {m0_bytes} = "
                f"{floor_bytes}; allowed: m_max_bytes >= {floor_bytes}"
            )
        self._m_max_bytes = m_max_bytes
        self._m0_bytes = m0_bytes
        self._num_microbatches = num_microbatches
        self._num_warmup = num_warmup
        self._share_bytes = m_max_bytes // num_warmup
        self._contain_overruns = contain_overruns
        self.reset()

    # ------------------------------------------------------------------ state
    def reset(self) -> None:
        """Forget everything recorded: start a new iteration with the same configuration."""
        self._in_flight: dict[int, int] = {}  # micro-batch -> measured bytes, forward recorded, backward not yet
        self._actual_bytes: dict[int, int] = {}  # micro-batch -> measured bytes of every forward recorded
        self._granted_bytes: dict[int, int] = {}  # micro-batch -> budget in force when its forward was recorded
        self._in_flight_bytes = 0
        self._peak_bytes = 0
        self._peeked: int | None = None  # what next_forward_budget returned, while nothing was recorded since
        self._held_back_bytes = 0  # overruns freed since the last forward, not passed on to the next one

    # ------------------------------------------------------------ properties
    @property
    def m_max_bytes(self) -> int:
        """Activation capacity of the stage in bytes."""
        return self._m_max_bytes

    @property
    def m0_bytes(self) -> int:
        """Floor of one micro-batch in bytes."""
        return self._m0_bytes

    @property
    def num_microbatches(self) -> int:
        """Forwards in one iteration (paper ``B``)."""
        return self._num_microbatches

    @property
    def num_warmup(self) -> int:
        """Forwards that stack before the first backward (paper ``B_w``)."""
        return self._num_warmup

    @property
    def contain_overruns(self) -> bool:
        """Whether a steady forward is kept from inheriting an overrun (the module docstring)."""
        return self._contain_overruns

    @property
    def in_flight_bytes(self) -> int:
        """Measured activation bytes of micro-batches forwarded but not yet backwarded."""
        return self._in_flight_bytes

    @property
    def peak_in_flight_bytes(self) -> int:
        """The most in-flight bytes after any forward recorded in this iteration."""
        return self._peak_bytes

    @property
    def num_launched(self) -> int:
        """Number of forwards recorded so far in this iteration."""
        return len(self._actual_bytes)

    @property
    def phase(self) -> BudgetPhase:
        """Phase of the next forward: WARMUP, STEADY, or DONE once all forwards were launched."""
        launched = len(self._actual_bytes)
        if launched < self._num_warmup:
            return BudgetPhase.WARMUP
        if launched < self._num_microbatches:
            return BudgetPhase.STEADY
        return BudgetPhase.DONE

    @property
    def in_flight_microbatches(self) -> tuple[int, ...]:
        """Micro-batches forwarded but not yet backwarded, in forward order."""
        return tuple(self._in_flight)

    @property
    def overrun_microbatches(self) -> tuple[int, ...]:
        """Micro-batches (this iteration) whose measured bytes exceeded the budget in force at their forward."""
        return tuple(mb for mb, granted in self._granted_bytes.items() if self._actual_bytes[mb] > granted)

    # ---------------------------------------------------------------- protocol
    def next_forward_budget(self) -> int:
        """Budget in bytes for the next forward micro-batch (read-only peek; idempotent).

        The value depends only on recorded state, so it changes only after ``record_forward`` or
        ``record_backward``. Raises ValueError once all ``num_microbatches`` forwards were launched.
        """
        return self.next_forward()[0]

    def next_forward(self) -> tuple[int, int | None]:
        """``(next_forward_budget(), absorb_limit_bytes())`` in warmup, ``(next_forward_budget(), None)`` in the
        steady phase: what a driver asks before each forward, in one call."""
        launched = len(self._actual_bytes)
        if launched >= self._num_microbatches:
            raise ValueError(
                f"next_forward_budget: all num_microbatches={self._num_microbatches} forwards were already "
                f"launched; call reset() to start a new iteration"
            )
        remaining_bytes = self._m_max_bytes - self._in_flight_bytes
        if launched >= self._num_warmup:
            remaining_bytes -= self._held_back_bytes
            self._peeked = budget = remaining_bytes if remaining_bytes > 0 else 0
            return budget, None
        later = self._num_warmup - launched - 1
        budget = remaining_bytes // (later + 1)
        self._peeked = budget = budget if budget > 0 else 0
        return budget, max(budget, remaining_bytes - later * self._m0_bytes)

    def absorb_limit_bytes(self) -> int:
        """The most the next forward may keep (deferred planning, §V-A): in warmup, what still leaves ``M_0`` for
        every later not-yet-launched warmup forward — an overrun of the budget up to it is absorbed by the next
        budgets shrinking, and those stay >= ``M_0``; in the steady phase the budget itself (no absorption)."""
        budget, limit = self.next_forward()
        return budget if limit is None else limit

    def record_forward(self, microbatch: int, actual_bytes: int) -> int:
        """Record that ``microbatch``'s forward finished keeping ``actual_bytes`` of activations in flight; returns
        the in-flight bytes after recording (``in_flight_bytes``).

        The in-flight total is re-based on ``actual_bytes`` (not on the budget). An actual above the budget is
        accepted (the caller may have overrun): it is noted in ``overrun_microbatches`` and later budgets shrink.
        Raises ValueError if ``microbatch`` is not an int in [0, num_microbatches), was already recorded this
        iteration, if ``actual_bytes`` is not an int >= 0, or if all forwards were already launched.
        """
        if type(microbatch) is not int or not 0 <= microbatch < self._num_microbatches:  # the hot path skips this
            microbatch = self._check_microbatch("record_forward", microbatch)
        if type(actual_bytes) is not int or actual_bytes < 0:
            actual_bytes = require_int("actual_bytes", actual_bytes, 0)
        actual = self._actual_bytes
        if microbatch in actual:
            raise ValueError(
                f"record_forward: microbatch={microbatch} was already recorded in this iteration; "
                f"allowed: a microbatch in [0, {self._num_microbatches}) not yet recorded"
            )
        # the budget in force: the caller usually just asked for it (nothing was recorded since); else compute it,
        # which cannot raise: fewer than num_microbatches were launched, as this one is in range and not recorded
        granted = self._peeked
        self._granted_bytes[microbatch] = granted if granted is not None else self.next_forward_budget()
        actual[microbatch] = actual_bytes
        self._in_flight[microbatch] = actual_bytes
        self._in_flight_bytes = held = self._in_flight_bytes + actual_bytes
        if held > self._peak_bytes:
            self._peak_bytes = held
        self._held_back_bytes = 0
        self._peeked = None
        return held

    def record_backward(self, microbatch: int) -> None:
        """Record that ``microbatch``'s backward finished, freeing its measured bytes.

        Raises ValueError if ``microbatch`` is not an int in [0, num_microbatches) or is not in flight.
        """
        if type(microbatch) is not int:  # bool, float, ... would match an int key: check first
            microbatch = self._check_microbatch("record_backward", microbatch)
        freed = self._in_flight.pop(microbatch, None)  # only checked, in-range micro-batches are ever in flight
        if freed is None:
            self._check_microbatch("record_backward", microbatch)  # out of range: that error first
            raise ValueError(
                f"record_backward: microbatch={microbatch} is not in flight; allowed: one of "
                f"{sorted(self._in_flight)}"
            )
        self._in_flight_bytes -= freed
        self._peeked = None
        if self._contain_overruns:  # an overrun beyond the micro-batch's budget and an even share: not passed on
            self._held_back_bytes += max(0, freed - max(self._granted_bytes[microbatch], self._share_bytes))
        assert self._in_flight_bytes >= 0

    # ----------------------------------------------------------------- helpers
    def _check_microbatch(self, where: str, microbatch: object) -> int:
        return require_int(f"{where}: microbatch", microbatch, 0, self._num_microbatches)

    def __repr__(self) -> str:
        return (
            f"BudgetAssigner(m_max_bytes={self._m_max_bytes}, m0_bytes={self._m0_bytes}, "
            f"num_microbatches={self._num_microbatches}, num_warmup={self._num_warmup}, "
            f"contain_overruns={self._contain_overruns}, phase={self.phase.value}, "
            f"num_launched={self.num_launched}, in_flight_bytes={self._in_flight_bytes})"
        )
