"""Imbalance traces for the simulator (paper §II-B): a seeded synthetic trace with the paper's statistics, and the
trainer's JSONL log read back.

A trace is a sequence with one entry per iteration: either one imbalance rate (a float; every micro-batch of the
iteration then gets that rate — the worst case for memory, as a spike hits every in-flight micro-batch at once) or
a tuple with one rate per micro-batch.

:func:`paper_trace` draws exactly ``round(spike_share * n)`` spike iterations (positions uniform without
replacement), their rates uniform in ``(base_high, spike_max]``; every other iteration uniform in
``[base_low, base_high]``. Rates are rounded to 2 decimals (spikes rounded *up*, so they stay above ``base_high``):
the simulator memoises whole iterations by their rates, and 0.01 is below what a gate's token counts resolve on
these models.

Where a spike falls: the paper's skew "occurs in a small fraction of micro-batches" (§II-B) and "a single
skewed batch can push the cumulative peak beyond device memory capacity". Without ``num_microbatches`` an
iteration is one rate (every micro-batch at it: the worst case). With it, a spike iteration is a tuple: its
spike rate on ``spike_microbatches`` micro-batches (default 1, the single skewed batch; or
``round(spike_microbatch_share * num_microbatches)``, at least 1, when a share is given) at positions drawn
uniformly, and an ordinary rate drawn as for the other iterations on the rest.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import stat
from dataclasses import dataclass
from pathlib import Path

from ..costmodel.build import check_imbalance
from ..costmodel.config import PARALLEL_MAX
from ..costmodel.validate import require_int, require_number
from .simulate import MAX_ITERATIONS

MAX_MICROBATCHES = PARALLEL_MAX["num_microbatches"]  # a micro-batch number is below it
MAX_RATE = float(PARALLEL_MAX["ep"])  # no expert-parallel rank receives more than ep times the mean

DECIMALS = 2


@dataclass(frozen=True, kw_only=True)
class PaperTrace:
    """The synthetic trace of the paper (§II-B: 97.1% of iterations at 1.0–1.2x, 2.9% spikes up to 2.6x).

      num_iterations  iterations (>= 1).
      seed            random seed (an integer >= 0).
      spike_share     share of spike iterations, in [0, 1].
      base_low        lowest ordinary rate (>= 1).
      base_high       highest ordinary rate (>= base_low).
      spike_max       highest spike rate (> base_high unless spike_share is 0).
      (the three rates are multiples of 0.01, the grid the rates are drawn on.)
      num_microbatches         micro-batches per iteration (>= 1), or None: one rate per iteration.
      spike_microbatches       micro-batches a spike hits (1 <= it <= num_microbatches), when no share is given.
      spike_microbatch_share   share of the micro-batches a spike hits, in (0, 1], or None.
    """

    num_iterations: int
    seed: int = 0
    spike_share: float = 0.029
    base_low: float = 1.0
    base_high: float = 1.2
    spike_max: float = 2.6
    num_microbatches: int | None = None
    spike_microbatches: int = 1
    spike_microbatch_share: float | None = None

    def __post_init__(self) -> None:
        require_int("num_iterations", self.num_iterations, 1, MAX_ITERATIONS, high_open=False)
        object.__setattr__(self, "seed", require_int("seed", self.seed, 0, 2**63))  # a numpy integer as a Python one
        require_number("spike_share", self.spike_share, 0, 1)
        require_number("base_low", self.base_low, 1, MAX_RATE)
        require_number("base_high", self.base_high, 1, MAX_RATE)
        if self.base_high < self.base_low:
            raise ValueError(f"base_high must be >= base_low ({self.base_low!r}), got {self.base_high!r}")
        require_number("spike_max", self.spike_max, 1, MAX_RATE)
        if self.spike_max < self.base_high or (self.spike_share > 0 and self.spike_max == self.base_high):
            spikes = self.spike_share > 0
            raise ValueError(f"spike_max must be {'>' if spikes else '>='} base_high ({self.base_high!r})"
                             f"{' while spike_share > 0' if spikes else ''}, got {self.spike_max!r}")
        scale = 10 ** DECIMALS
        for name in ("base_low", "base_high", "spike_max"):
            value = getattr(self, name)
            if abs(value * scale - round(value * scale)) > 1e-6:  # off the grid the draws collapse on one bound
                raise ValueError(f"{name} must be a multiple of {1 / scale:g} (rates are drawn at {DECIMALS} "
                                 f"decimals), got {value!r}")
        lowest = self.lowest_spike
        if self.spike_share > 0 and self.spike_max < lowest - 1e-9:
            raise ValueError(f"spike_max must be at least {lowest:g} (the smallest rate above base_high at "
                             f"{DECIMALS} decimals) when spike_share > 0, got {self.spike_max!r}")
        if self.num_microbatches is not None:
            require_int("num_microbatches", self.num_microbatches, 1, MAX_MICROBATCHES, high_open=False)
        most = MAX_MICROBATCHES if self.num_microbatches is None else self.num_microbatches
        require_int("spike_microbatches", self.spike_microbatches, 1, most, high_open=False)
        if self.num_microbatches is None and (self.spike_microbatches != 1 or self.spike_microbatch_share is not None):
            raise ValueError("spike_microbatches and spike_microbatch_share need num_microbatches (without it an "
                             "iteration is one rate, on every micro-batch)")
        if self.spike_microbatch_share is not None:
            require_number("spike_microbatch_share", self.spike_microbatch_share, 0, 1, low_open=True,
                           high_open=False)

    @property
    def lowest_spike(self) -> float:
        """The smallest spike rate: the first rate above ``base_high`` at ``DECIMALS`` decimals."""
        scale = 10 ** DECIMALS
        return (math.floor(self.base_high * scale + 1e-9) + 1) / scale

    @property
    def hit_microbatches(self) -> int | None:
        """How many micro-batches a spike hits (None without ``num_microbatches``)."""
        if self.num_microbatches is None:
            return None
        if self.spike_microbatch_share is None:
            return self.spike_microbatches
        return min(self.num_microbatches, max(1, round(self.spike_microbatch_share * self.num_microbatches)))

    def rates(self) -> tuple:
        """One rate per iteration, or with ``num_microbatches`` a tuple of rates for each spike iteration."""
        rates = self._iteration_rates()
        hit = self.hit_microbatches
        if hit is None:
            return rates
        rng = random.Random(f"{self.seed}:microbatches")  # the iteration rates stay those of the same seed
        out = []
        for rate in rates:
            if rate <= self.base_high:
                out.append(rate)
                continue
            ordinary = round(rng.uniform(self.base_low, self.base_high), DECIMALS)
            ordinary = min(max(ordinary, self.base_low), self.base_high)
            skewed = set(rng.sample(range(self.num_microbatches), hit))
            out.append(tuple(rate if m in skewed else ordinary for m in range(self.num_microbatches)))
        return tuple(out)

    def _iteration_rates(self) -> tuple[float, ...]:
        rng = random.Random(self.seed)
        n = self.num_iterations
        spikes = set(rng.sample(range(n), round(self.spike_share * n)))
        scale = 10 ** DECIMALS
        floor = round(self.lowest_spike * scale)  # the smallest rounded rate above base_high
        out = []
        for i in range(n):
            if i in spikes:
                drawn = math.ceil(rng.uniform(self.base_high, self.spike_max) * scale - 1e-9)
                out.append(min(max(drawn, floor), math.floor(self.spike_max * scale + 1e-9)) / scale)
            else:
                drawn = round(rng.uniform(self.base_low, self.base_high), DECIMALS)
                out.append(min(max(drawn, self.base_low), self.base_high))
        return tuple(out)


def paper_trace(num_iterations: int, *, seed: int = 0, spike_share: float = 0.029, base_low: float = 1.0,
                base_high: float = 1.2, spike_max: float = 2.6, num_microbatches: int | None = None,
                spike_microbatches: int = 1, spike_microbatch_share: float | None = None) -> tuple:
    """Imbalance rates with the paper's statistics (see :class:`PaperTrace`); seeded. One rate per iteration, or
    with ``num_microbatches`` a per-micro-batch tuple for each spike iteration (the spike on a few of them)."""
    return PaperTrace(num_iterations=num_iterations, seed=seed, spike_share=spike_share, base_low=base_low,
                      base_high=base_high, spike_max=spike_max, num_microbatches=num_microbatches,
                      spike_microbatches=spike_microbatches, spike_microbatch_share=spike_microbatch_share).rates()


def _metrics_rows(records: list[tuple[int, dict]], path) -> dict[int, dict[int, float]]:
    """The trainer's metrics log (``--metrics-file``): per step, micro-batch m's rate is, over the stages and ranks
    that logged it, the largest mean over the chunk's MoE layers of the device imbalance each layer measured (at
    least 1). The mean, because a chunk's routed bytes and expert time are linear in each layer's tokens and its
    MoE layers have one shape: the graph at the mean rate keeps the bytes the layers kept together. The last
    record of a step wins (a restart re-runs steps); OOM and summary records are skipped."""
    rows: dict[int, dict[int, float]] = {}
    for number, row in records:
        if row.get("summary") or row.get("oom") or "microbatches" not in row:
            continue
        label = f"{path}: line {number}"
        shape = ('expected the trainer\'s metrics record: "step" and "microbatches", a list of {"microbatch": m, '
                 '"imbalance": [r, ...]}')
        try:
            step = require_int("step", row.get("step"), 0)
            per: dict[int, float] = {}
            entries = row["microbatches"]
            if not isinstance(entries, list) or not all(isinstance(entry, dict) and "microbatch" in entry
                                                        for entry in entries):
                raise ValueError(shape)
            for entry in entries:
                microbatch = require_int("microbatch", entry["microbatch"], 0, MAX_MICROBATCHES)
                measured = entry.get("imbalance")
                measured = [] if measured is None else measured  # a chunk with no MoE layer logs none
                if not isinstance(measured, list):
                    raise ValueError(f"micro-batch {microbatch}: imbalance must be a list of numbers, got "
                                     f"{measured!r:.40}")
                rates = [require_number("imbalance", r, 0) for r in measured]
                mean = sum(r / len(rates) for r in rates) if rates else 1.0  # finite for finite rates
                per[microbatch] = max(per.get(microbatch, 1.0), mean)
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from None
        rows[step] = per
    return rows


def load_trace(path: str | Path) -> tuple[tuple[float, ...], ...]:
    """Per-iteration, per-micro-batch rates from a JSONL log: either one object a line,
    ``{"iteration": i, "microbatch": m, "imbalance": r}``, or the trainer's metrics file (``--metrics-file``: see
    :func:`_metrics_rows`). Blank lines are skipped. Iterations and micro-batches must each be numbered 0, 1, ...
    without gaps, every iteration with the same micro-batch count, no duplicate; anything else is a one-line
    ``ValueError`` naming the line (or the file, for one that cannot be read)."""
    rows: dict[int, dict[int, float]] = {}
    where = {}
    records = []
    if not isinstance(path, (str, os.PathLike)):  # an integer would be read as a file descriptor
        raise ValueError(f"path must be a file path (str or os.PathLike), got {type(path).__name__}")
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or a device would block or never end
            raise ValueError(f"{path}: not a regular file")
        handle = open(path, encoding="utf-8-sig")
    except OSError as exc:  # missing, no read permission, a name too long: one line, as for its content
        raise ValueError(f"{path}: cannot read the trace ({exc.strerror or exc})") from None
    with handle:
        lines = enumerate(handle, 1)
        while True:
            try:
                number, line = next(lines)
            except StopIteration:
                break
            except UnicodeDecodeError:
                raise ValueError(f"{path}: not UTF-8 text (a JSONL trace is expected)") from None
            if not line.strip():
                continue
            label = f"{path}: line {number}"
            try:
                row = json.loads(line)
            except (ValueError, RecursionError):  # JSONDecodeError, or an integer too long to convert
                raise ValueError(f"{label}: not valid JSON") from None
            if isinstance(row, dict) and ("microbatches" in row or "summary" in row or "oom" in row):
                records.append((number, row))
                continue
            if not isinstance(row, dict) or set(row) != {"iteration", "microbatch", "imbalance"}:
                raise ValueError(f'{label}: expected {{"iteration": i, "microbatch": m, "imbalance": r}} or a '
                                 "record of the trainer's metrics file")
            try:
                iteration = require_int("iteration", row["iteration"], 0)
                microbatch = require_int("microbatch", row["microbatch"], 0, MAX_MICROBATCHES)
                rate = check_imbalance(row["imbalance"])
            except ValueError as exc:
                raise ValueError(f"{label}: {exc}") from None
            per = rows.setdefault(iteration, {})
            if microbatch in per:
                raise ValueError(f"{label}: iteration {iteration} micro-batch {microbatch} appears twice")
            per[microbatch] = rate
            where[iteration] = number
    if records:
        if rows:
            raise ValueError(f"{path}: mixes trace rows with the trainer's metrics records")
        rows = _metrics_rows(records, path)
        where = {row["step"]: number for number, row in records
                 if "microbatches" in row and isinstance(row.get("step"), int)}
    if not rows:
        raise ValueError(f"{path}: no trace rows")
    count = max((max(per) + 1 for per in rows.values() if per), default=0)  # micro-batches: the highest seen
    if not count:
        raise ValueError(f"{path}: no micro-batch in any iteration")
    trace = []
    for expected, iteration in enumerate(sorted(rows)):
        if iteration != expected:
            raise ValueError(f"{path}: iteration {expected} is missing (iterations must be numbered 0, 1, ... "
                             f"without gaps; the next is {iteration}, line {where[iteration]})")
        per = rows[iteration]
        if len(per) != count:  # the first missing numbers, found in at most len(per) + 9 steps
            missing = list(itertools.islice((m for m in range(count) if m not in per), 9))
            shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
            raise ValueError(f"{path}: line {where[iteration]}: iteration {iteration} lacks micro-batch(es) "
                             f"{shown} (this trace numbers micro-batches 0..{count - 1})")
        trace.append(tuple(per[m] for m in range(count)))
    return tuple(trace)
