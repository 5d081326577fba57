"""The pipeline's timeline (``bagualu2.sim.timeline``): Megatron's interleaved 1F1B time where every chunk's
forward and backward take the same time, the waits an F_x B_y point that starts with both inputs and sends after
it causes at one chunk per stage, and the spans the gradient traffic hides in."""

from __future__ import annotations

import pytest

from bagualu2.costmodel import ParallelConfig
from bagualu2.costmodel.pipeline import points
from bagualu2.sim.timeline import Step, spans

FORWARD_S, BACKWARD_S = 1.0, 2.0


def steps_of(parallel: ParallelConfig, *, together: bool) -> list[list[Step]]:
    """Every stage's steps with uniform chunk times; ``together``: each point F_x B_y one step (both inputs
    first, its outputs at its end), else its forward and backward as two steps."""
    stages = []
    for stage in range(parallel.pp):
        steps = []
        for point in points(parallel, stage):
            if together and len(point) == 2:
                x, y = point
                seconds = FORWARD_S + BACKWARD_S
                steps.append(Step((x.microbatch, x.chunk), (y.microbatch, y.chunk), seconds, seconds))
                continue
            for action in point:
                key = (action.microbatch, action.chunk)
                steps.append(Step(key, None, FORWARD_S, FORWARD_S) if action.kind == "F"
                             else Step(None, key, BACKWARD_S, 0.0))
        stages.append(steps)
    return stages


LAYOUTS = [(1, 1, 4, False), (2, 1, 8, False), (4, 1, 8, False), (4, 2, 8, False), (8, 2, 16, False),
           (2, 4, 8, False), (4, 2, 8, True), (8, 2, 64, True), (4, 2, 4, False), (8, 4, 32, True)]


@pytest.mark.parametrize("pp, vp, m, paired", LAYOUTS)
def test_uniform_steps_take_megatrons_interleaved_1f1b_time(pp, vp, m, paired):
    """(m·vp + pp − 1) chunk forwards and backwards: the steady steps plus the bubble."""
    parallel = ParallelConfig(pp=pp, vp=vp, num_microbatches=m, paired=paired)
    ends = [span.end_s for span in spans(steps_of(parallel, together=False), vp)]
    assert max(ends) == pytest.approx((m * vp + pp - 1) * (FORWARD_S + BACKWARD_S), rel=1e-12)
    assert ends[0] == max(ends)  # the first stage runs the last backward


@pytest.mark.parametrize("pp, vp, m, paired", [layout for layout in LAYOUTS if layout[1] > 1])
def test_points_run_together_cost_no_wait_with_virtual_stages(pp, vp, m, paired):
    """With two or more chunks per stage a neighbour's warmup is two chunk-forwards longer: a point that waits for
    both its inputs and sends after it ends finds them there."""
    parallel = ParallelConfig(pp=pp, vp=vp, num_microbatches=m, paired=paired)
    apart, together = (max(span.end_s for span in spans(steps_of(parallel, together=t), vp)) for t in (False, True))
    assert together == pytest.approx(apart, rel=1e-12)


@pytest.mark.parametrize("pp, paired", [(2, False), (4, False), (2, True), (4, True)])
def test_points_run_together_make_neighbours_wait_at_one_chunk_per_stage(pp, paired):
    """At vp = 1 a neighbour's warmup is one forward longer: stage s's point k needs the backward stage s + 1
    runs after the forward s's point k − 1 sends at its end, so every steady step waits a neighbour's step."""
    parallel = ParallelConfig(pp=pp, num_microbatches=16, paired=paired)
    apart, together = (max(span.end_s for span in spans(steps_of(parallel, together=t), 1)) for t in (False, True))
    assert apart == pytest.approx((16 + pp - 1) * (FORWARD_S + BACKWARD_S))
    assert together > 1.5 * apart


def test_spans_mark_the_first_micro_batchs_forwards_and_the_last_ones_backwards():
    parallel = ParallelConfig(pp=2, num_microbatches=3)
    first, last = spans(steps_of(parallel, together=False), 1)
    # stage 0: F0 F1 B0 F2 B1 B2; stage 1: F0 B0 F1 B1 F2 B2
    assert first.first_forwards_end_s == 1.0 and last.first_forwards_end_s == 2.0
    assert last.last_backwards_start_s == last.end_s - BACKWARD_S
    assert first.last_backwards_start_s == first.end_s - BACKWARD_S


def test_steps_that_wait_on_each_other_are_an_error():
    """A backward placed before the forward it needs on the next stage can never run."""
    stuck = [[Step(None, (0, 0), 1.0, 0.0), Step((0, 0), None, 1.0, 1.0)], [Step((0, 0), None, 1.0, 1.0),
                                                                            Step(None, (0, 0), 1.0, 0.0)]]
    with pytest.raises(RuntimeError, match="wait on each other: stage 0 at step 0"):
        spans(stuck, 1)
