"""Pipeline-iteration model (paper §IV-A, Fig. 5c): 1F1B and interleaved 1F1B schedules and memory curves.

A schedule is the per-stage sequence of ``Action(kind, microbatch, chunk)``: warmup forwards, steady
forward/backward pairs, cooldown backwards (Megatron's order; with ``vp > 1`` the interleaved one; with
``paired``, Megatron-Core's combined 1F1B: one more warmup forward, so that no steady pair holds a forward and its
own backward; at pp = 1 one warmup forward, then F_(i+1) B_i). The memory
curve adds a chunk's activation bytes at each forward and frees them at its backward, so spikes are fed in by
giving a micro-batch more bytes.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Iterator, Sequence, Union

from .config import ParallelConfig
from .validate import require_int, require_number

ChunkBytes = Union[int, Sequence[int]]


@dataclass(frozen=True, slots=True)
class Action:
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int


def _check_stage(parallel: ParallelConfig, stage: int) -> None:
    require_int("stage", stage, 0, parallel.pp)


def num_warmup(parallel: ParallelConfig, stage: int = 0) -> int:
    """Forwards of ``stage`` before its first steady 1F1B pair: Megatron's warmup count, one more when
    ``parallel.paired`` (Megatron-Core's combined 1F1B: every steady F_x B_y then pairs independent micro-batches,
    on the last stage too)."""
    _check_stage(parallel, stage)
    pp, vp, m = parallel.pp, parallel.vp, parallel.num_microbatches
    if vp == 1:
        return min(pp - stage - 1 + parallel.paired, m)
    total = m * vp
    if m == pp:
        return total
    return min((pp - stage - 1) * 2 + (vp - 1) * pp + parallel.paired, total)


def schedule(parallel: ParallelConfig, stage: int = 0) -> tuple[Action, ...]:
    """Order of forward and backward chunk executions on ``stage`` for one iteration."""
    return tuple(Action("F" if forward else "B", microbatch, chunk)
                 for forward, microbatch, chunk in _order(parallel, stage))


def _order(parallel: ParallelConfig, stage: int) -> Iterator[tuple[bool, int, int]]:
    """:func:`schedule`'s actions as ``(forward, micro-batch, chunk)``, one at a time."""
    pp, vp, m = parallel.pp, parallel.vp, parallel.num_microbatches
    total, group_size = m * vp, pp * vp

    def step(k: int, forward: bool) -> tuple[bool, int, int]:
        group = k % group_size
        chunk = group // pp if forward else vp - 1 - group // pp
        microbatch = (k // group_size) * pp + k % pp if vp > 1 else k
        return forward, microbatch, chunk

    warmup = num_warmup(parallel, stage)
    for k in range(warmup):
        yield step(k, True)
    for i in range(total - warmup):
        yield step(warmup + i, True)
        yield step(i, False)
    for k in range(total - warmup, total):
        yield step(k, False)


def points(parallel: ParallelConfig, stage: int = 0) -> tuple[tuple[Action, ...], ...]:
    """``schedule(parallel, stage)`` grouped as it runs: each steady forward (after the ``num_warmup``) with the
    backward after it, of another micro-batch, is one scheduling point ``(F_x, B_y)``; every other action is alone
    ``(action,)``."""
    actions = schedule(parallel, stage)
    warmup = num_warmup(parallel, stage)
    grouped: list[tuple[Action, ...]] = []
    index = forwards = 0
    while index < len(actions):
        action = actions[index]
        following = actions[index + 1] if index + 1 < len(actions) else None
        steady = action.kind == "F" and forwards >= warmup
        forwards += action.kind == "F"
        if steady and following is not None and following.kind == "B" and following.microbatch != action.microbatch:
            grouped.append((action, following))
            index += 2
        else:
            grouped.append((action,))
            index += 1
    return tuple(grouped)


def point_relation(parallel: ParallelConfig, stage: int = 0) -> int:
    """How far apart the micro-batches of ``stage``'s scheduling points F_x B_y are, as §V-B's ``x - y`` (the
    fusion DP's ``pipeline_degree``): 1 when a point's offload (of the forward before F_x) would copy B_y's own
    micro-batch, 2 when it would copy the recovery's (of the backward after B_y), else 3 (four distinct
    micro-batches); the most constrained point decides. 3 when the stage has no scheduling point."""
    actions = schedule(parallel, stage)
    position = {action: i for i, action in enumerate(actions)}  # an action is (kind, micro-batch, chunk): unique
    relation = 3
    for point in points(parallel, stage):
        if len(point) != 2:
            continue
        forward, backward = point
        before = next((a for a in reversed(actions[:position[forward]]) if a.kind == "F"), None)
        after = next((a for a in actions[position[backward] + 1:] if a.kind == "B"), None)
        if before is None:
            continue
        if (before.microbatch, before.chunk) == (backward.microbatch, backward.chunk):
            return 1
        if after is not None and (before.microbatch, before.chunk) == (after.microbatch, after.chunk):
            relation = 2
    return relation


def inflight_chunks(parallel: ParallelConfig, stage: int = 0) -> int:
    """Most chunk activations ``stage`` holds at once: its warmup forwards, and one more when a steady phase
    follows (each steady forward comes before the backward it pairs with)."""
    return min(num_warmup(parallel, stage) + 1, parallel.num_microbatches * parallel.vp)


def inflight_microbatches(parallel: ParallelConfig, stage: int = 0) -> float:
    """In-flight activations in units of one micro-batch's whole-stage activation (``vp`` chunks).

    1F1B: ``min(pp - stage, m)``; interleaved first stage: ``pp * (1 + (pp - 1) / (pp * vp))``.
    """
    return inflight_chunks(parallel, stage) / parallel.vp


def _is_count(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _checked_bytes(per_microbatch: Sequence[ChunkBytes], vp: int) -> list[int | tuple[int, ...]]:
    """Each micro-batch's entry checked once: an int (every chunk's bytes) or ``vp`` per-chunk ints."""
    rows: list[int | tuple[int, ...]] = []
    for microbatch, entry in enumerate(per_microbatch):
        if microbatch and entry is per_microbatch[microbatch - 1]:  # the same object again (``[entry] * m``)
            rows.append(rows[-1])
            continue
        if _is_count(entry):
            if entry < 0:
                raise ValueError(f"bytes of micro-batch {microbatch} must be >= 0, got {entry}")
            rows.append(int(entry))
            continue
        if (isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != vp
                or not all(_is_count(value) for value in entry)):
            raise ValueError(f"bytes of micro-batch {microbatch} must be an int or {vp} per-chunk ints, got "
                             f"{entry!r:.60}")
        rows.append(tuple(map(int, entry)))
        if any(nbytes < 0 for nbytes in rows[-1]):
            raise ValueError(f"bytes of micro-batch {microbatch} must be >= 0, got {min(rows[-1])}")
    return rows


def memory_curve(parallel: ParallelConfig, per_microbatch_bytes: Sequence[ChunkBytes], *, stage: int = 0,
                 base_bytes: int = 0) -> tuple[int, ...]:
    """Activation bytes held by ``stage`` after each action of :func:`schedule` (``base_bytes`` first).

    ``per_microbatch_bytes[i]`` is the bytes one chunk-forward of micro-batch ``i`` keeps: an int (same for
    every chunk) or ``vp`` ints. A spike is a larger entry.
    """
    return tuple(_held(parallel, per_microbatch_bytes, stage, require_int("base_bytes", base_bytes, 0)))


def _held(parallel: ParallelConfig, per_microbatch_bytes: Sequence[ChunkBytes], stage: int,
          held: int) -> Iterator[int]:
    """The bytes held from ``held`` on, after each action of the schedule: :func:`memory_curve`'s points."""
    if not isinstance(parallel, ParallelConfig):
        raise ValueError(f"parallel must be a ParallelConfig, got {type(parallel).__name__}")
    if isinstance(per_microbatch_bytes, (str, bytes)) or not isinstance(per_microbatch_bytes, Sequence):
        raise ValueError("per_microbatch_bytes must be a sequence of one entry per micro-batch, got "
                         f"{type(per_microbatch_bytes).__name__}")
    if len(per_microbatch_bytes) != parallel.num_microbatches:
        raise ValueError(f"per_microbatch_bytes must have num_microbatches={parallel.num_microbatches} entries, "
                         f"got {len(per_microbatch_bytes)}")
    _check_stage(parallel, stage)
    rows = _checked_bytes(per_microbatch_bytes, parallel.vp)
    return _walk(_order(parallel, stage), rows, held)


def _walk(order, rows: list, held: int) -> Iterator[int]:
    yield held
    for forward, microbatch, chunk in order:
        row = rows[microbatch]
        nbytes = row if isinstance(row, int) else row[chunk]
        held += nbytes if forward else -nbytes
        yield held


def peak_bytes(parallel: ParallelConfig, per_microbatch_bytes: Sequence[ChunkBytes], *, stage: int = 0) -> int:
    """``max(memory_curve(parallel, per_microbatch_bytes, stage=stage))``, without the curve."""
    return max(_held(parallel, per_microbatch_bytes, stage, 0))


def timed_curve(parallel: ParallelConfig, per_microbatch_bytes: Sequence[ChunkBytes], *, forward_s: float,
                backward_s: float, stage: int = 0) -> tuple[tuple[float, int], ...]:
    """The curve as ``(time_s, bytes)`` corners: forward triangles rise over ``forward_s``, backward ones fall
    over ``backward_s`` (micro-batch level of Fig. 5b; pipeline bubbles are not drawn)."""
    forward_s = require_number("forward_s", forward_s, 0, low_open=True)
    backward_s = require_number("backward_s", backward_s, 0, low_open=True)
    curve = memory_curve(parallel, per_microbatch_bytes, stage=stage)
    points = [(0.0, curve[0])]
    now = 0.0
    for action, held in zip(schedule(parallel, stage), curve[1:]):
        now += forward_s if action.kind == "F" else backward_s
        points.append((now, held))
    return tuple(points)
