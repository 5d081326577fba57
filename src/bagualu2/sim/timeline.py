"""The pipeline's timeline: every stage runs its steps in schedule order, each as soon as its stage is free and
what it consumes has arrived from the neighbouring stages.

A step is a chunk forward, a chunk backward, or both at one scheduling point ``F_x B_y``. A forward of
(micro-batch, chunk) needs the same chunk's forward on the stage before, or on the first stage the previous chunk's
forward on the last stage (interleaved 1F1B); a backward needs the same chunk's backward on the stage after, or on
the last stage the next chunk's backward on the first stage (the last chunk's backward starts from the loss, its
own forward on that stage). Point-to-point transfers take no time (not modelled). A step's backward output leaves
when the step ends; its forward output leaves at ``forward_out_s`` after its start: the step's end where its
forward and backward run together (Megatron-Core's combined 1F1B step and the fused point send after the whole
point), when its forward part ends where it runs F then B.

The warmup and cooldown ramps (the interleaved 1F1B bubble) and every wait between stages follow from the steps'
own times: a stage whose steps are slower than its neighbours' holds them up, and at one chunk per stage
(``vp = 1``) a point that sends its forward only at its end makes the next stage wait for it every step.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


class Step(NamedTuple):
    """One step of a stage: ``forward`` and ``backward`` as (micro-batch, chunk) or None, its ``seconds``, and
    when after its start its forward's output leaves (``forward_out_s``, at most ``seconds``)."""

    forward: tuple[int, int] | None
    backward: tuple[int, int] | None
    seconds: float
    forward_out_s: float


class Span(NamedTuple):
    """One stage's iteration on the timeline, in seconds from the iteration's start: when its last step ends, when
    the steps holding the first micro-batch's forwards have all ended (the parameters it gathers are needed by
    then), and when the first step holding a backward of the last micro-batch starts (gradients become final from
    then on)."""

    end_s: float
    first_forwards_end_s: float
    last_backwards_start_s: float


def spans(stages: Sequence[Sequence[Step]], vp: int) -> list[Span]:
    """Each stage's :class:`Span` (``stages``: each stage's steps in the order it runs them; ``vp``: chunks per
    stage)."""
    pp = len(stages)
    last = max((step.backward[0] for steps in stages for step in steps if step.backward is not None), default=0)
    first_end = [0.0] * pp
    last_start = [float("inf")] * pp
    forwards: list[dict[tuple[int, int], float]] = [{} for _ in range(pp)]   # when each forward's output left
    backwards: list[dict[tuple[int, int], float]] = [{} for _ in range(pp)]  # when each backward's output left
    position, free = [0] * pp, [0.0] * pp
    remaining = sum(len(steps) for steps in stages)
    while remaining:
        moved = False
        for s, steps in enumerate(stages):
            done_forward, done_backward = forwards[s], backwards[s]
            before = forwards[s - 1] if s > 0 else forwards[pp - 1]  # where a forward's input comes from
            after = backwards[s + 1] if s < pp - 1 else backwards[0]  # where a backward's gradient comes from
            at, start_s = position[s], free[s]
            while at < len(steps):
                forward, backward, seconds, forward_out_s = steps[at]
                start = start_s
                if forward is not None:
                    if s > 0:
                        arrived = before.get(forward)
                    else:
                        arrived = before.get((forward[0], forward[1] - 1)) if forward[1] > 0 else 0.0
                    if arrived is None:
                        break
                    if arrived > start:
                        start = arrived
                if backward is not None:
                    if s < pp - 1:
                        arrived = after.get(backward)
                    elif backward[1] < vp - 1:
                        arrived = after.get((backward[0], backward[1] + 1))
                    else:  # the loss: this stage's own forward, run at an earlier step
                        arrived = done_forward.get(backward)
                    if arrived is None:
                        break
                    if arrived > start:
                        start = arrived
                start_s = start + seconds
                if forward is not None:
                    done_forward[forward] = start + forward_out_s
                    if forward[0] == 0:
                        first_end[s] = start_s
                if backward is not None:
                    done_backward[backward] = start_s
                    if backward[0] == last and start < last_start[s]:
                        last_start[s] = start
                at += 1
            if at != position[s]:
                remaining -= at - position[s]
                position[s], free[s] = at, start_s
                moved = True
        if not moved:
            stuck = ", ".join(f"stage {s} at step {position[s]}" for s in range(pp) if position[s] < len(stages[s]))
            raise RuntimeError(f"the pipeline's steps wait on each other: {stuck}")
    return [Span(end, first, min(start, end)) for end, first, start in zip(free, first_end, last_start)]
