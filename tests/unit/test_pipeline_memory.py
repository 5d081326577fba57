"""Pipeline schedules, in-flight counts, memory curves with spikes, and static memory."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bagualu2.costmodel import (ParallelConfig, Plan, inflight_chunks, inflight_microbatches, memory_curve,
                                presets, schedule, stage_memory, static_bytes)
from bagualu2.costmodel.pipeline import num_warmup, peak_bytes, point_relation, points


@given(pp=st.integers(1, 16), m=st.integers(1, 64), data=st.data())
def test_1f1b_inflight(pp, m, data):
    parallel = ParallelConfig(pp=pp, num_microbatches=m)
    stage = data.draw(st.integers(0, pp - 1))
    assert inflight_chunks(parallel, 0) == min(pp, m)
    assert inflight_chunks(parallel, stage) == min(pp - stage, m)
    actions = schedule(parallel, stage)
    assert sorted((a.microbatch, a.kind) for a in actions) == sorted(
        [(i, "F") for i in range(m)] + [(i, "B") for i in range(m)])


@given(pp=st.integers(2, 12), vp=st.integers(2, 4), k=st.integers(2, 4))
def test_interleaved_first_stage_factor(pp, vp, k):
    parallel = ParallelConfig(pp=pp, vp=vp, num_microbatches=k * pp)
    assert inflight_microbatches(parallel, 0) == pytest.approx(pp * (1 + (pp - 1) / (pp * vp)))
    # every chunk's backward follows its forward
    done = set()
    for action in schedule(parallel, 0):
        key = (action.microbatch, action.chunk)
        if action.kind == "F":
            done.add(key)
        else:
            assert key in done


@given(pp=st.integers(2, 8), vp=st.integers(1, 3), k=st.integers(2, 4), base=st.integers(1, 10**9),
       spike=st.integers(0, 10**9), data=st.data())
def test_spike_in_warmup_raises_peak_by_its_bytes(pp, vp, k, base, spike, data):
    parallel = ParallelConfig(pp=pp, vp=vp, num_microbatches=k * pp)
    flat = [base] * parallel.num_microbatches
    spiked = list(flat)
    victim = data.draw(st.integers(0, min(pp, parallel.num_microbatches) - 1))  # launched during warmup
    spiked[victim] = base + spike
    per_chunk = [base] * vp
    per_chunk[-1] = base + spike
    spiked_one_chunk = list(flat)
    spiked_one_chunk[victim] = per_chunk
    assert peak_bytes(parallel, spiked) == peak_bytes(parallel, flat) + vp * spike
    assert peak_bytes(parallel, spiked_one_chunk) == peak_bytes(parallel, flat) + spike
    curve = memory_curve(parallel, flat)
    assert curve[0] == 0 and curve[-1] == 0


@given(m=st.integers(1, 32), ep=st.sampled_from([1, 2, 4]))
def test_paired_without_a_pipeline_runs_f_next_beside_b(m, ep):
    """Combined 1F1B at pp=1: one warmup forward, then F_(i+1) B_i, then B_(m-1); two micro-batches in flight."""
    parallel = ParallelConfig(dp=4, ep=ep, num_microbatches=m, paired=True)
    expected = [("F", 0)] + [kind for i in range(m - 1) for kind in (("F", i + 1), ("B", i))] + [("B", m - 1)]
    assert [(a.kind, a.microbatch) for a in schedule(parallel)] == expected
    assert num_warmup(parallel) == 1 and inflight_chunks(parallel) == min(2, m)
    assert [tuple(a.microbatch for a in group) for group in points(parallel)] == (
        [(0,)] + [(i + 1, i) for i in range(m - 1)] + [(m - 1,)])
    assert inflight_chunks(parallel.replace(paired=False)) == 1


def test_paired_is_a_bool():
    with pytest.raises(ValueError, match="paired must be true or false"):
        ParallelConfig(paired=1)


@pytest.mark.parametrize("pp, vp, m", [(2, 1, 4), (4, 1, 8), (4, 2, 8), (8, 2, 64), (3, 1, 2)])
def test_paired_adds_one_warmup_forward_so_no_steady_pair_holds_its_own_backward(pp, vp, m):
    plain, paired = ParallelConfig(pp=pp, vp=vp, num_microbatches=m), ParallelConfig(pp=pp, vp=vp,
                                                                                    num_microbatches=m, paired=True)
    for stage in range(pp):
        assert num_warmup(paired, stage) == min(num_warmup(plain, stage) + 1, m * vp)
        pairs = [point for point in points(paired, stage) if len(point) == 2]
        assert all(f.microbatch != b.microbatch for f, b in pairs)
        if num_warmup(paired, stage) < m * vp:  # a steady phase: its forwards all pair
            assert len(pairs) == m * vp - num_warmup(paired, stage)
    last = [point for point in points(plain, pp - 1) if len(point) == 2]
    assert len(last) < m * vp - num_warmup(plain, pp - 1)  # without: the last stage runs F_i right before B_i


def test_warmup_counts():
    assert num_warmup(ParallelConfig(pp=4, num_microbatches=8), 0) == 3
    assert num_warmup(ParallelConfig(pp=4, vp=2, num_microbatches=8), 0) == 2 * 3 + 4
    assert num_warmup(ParallelConfig(pp=4, vp=2, num_microbatches=4), 0) == 8  # m == pp: all warmup


def test_static_memory_glm_423b_stage0():
    """Hand derivation, glm-423b-a30b (h=8192, a=64, g=8, d=128, fe=4096, E=128, S=1, V=151552), stage 0.

    pp=8, vp=2: stage 0 holds chunks 0 and 1 = layers 0-1 and 16-17, all MoE; tp=2, ep=64, dp=32, edp=1.
    attention = h*(a+2g)*d + a*d*h = 8192*80*128 + 64*128*8192 = 150,994,944; /tp = 75,497,472
    norms 2h = 16,384; router h*E = 1,048,576; shared expert 3*h*fe/tp = 50,331,648
    dense per layer = 126,894,080; x4 layers = 507,576,320; + embedding V*h/tp = 620,756,992
    -> P_d = 1,128,333,312
    experts per layer E/ep = 2 x 3*h*fe = 201,326,592; x4 -> P_e = 805,306,368
    static = (2 + 4)*(P_d + P_e) + 12*P_d/32 + 12*P_e/1
           = 11,601,838,080 + 423,124,992 + 9,663,676,416 = 21,688,639,488 bytes
    """
    model, parallel = presets.model("glm-423b-a30b")
    assert static_bytes(model, parallel, stage=0) == 21_688_639_488


def test_stage_memory_peak_and_budget_inputs():
    model, parallel = presets.model("glm-423b-a30b")
    hw = presets.hardware("paper-gpu")
    mem = stage_memory(model, parallel, hw, stage=0)
    assert mem.peak_bytes == mem.static_bytes + mem.activation_peak_bytes
    assert mem.activation_peak_bytes == max(memory_curve(parallel, [mem.chunk_bytes] * parallel.num_microbatches))
    assert mem.inflight_microbatches == pytest.approx(8 * (1 + 7 / 16) + 1 / 2)  # paired: one more chunk
    plain = stage_memory(model, dataclasses.replace(parallel, paired=False), hw, stage=0)
    assert plain.inflight_microbatches == pytest.approx(8 * (1 + 7 / 16))
    assert mem.m_max_bytes == hw.hbm_bytes - hw.reserved_bytes - mem.static_bytes
    spike = stage_memory(model, parallel, hw, stage=0, imbalance=2.6)
    assert spike.activation_peak_bytes > mem.activation_peak_bytes
    mitigated = stage_memory(model, parallel, hw, stage=0, plan=Plan.uniform({"expert_act": "RECOMPUTE"}))
    assert mitigated.activation_peak_bytes < mem.activation_peak_bytes
    last = stage_memory(model, parallel, hw, stage=parallel.pp - 1)
    assert last.m_max_bytes < hw.hbm_bytes - hw.reserved_bytes - last.static_bytes  # logits on the last stage
    with pytest.raises(ValueError, match="does not have"):
        stage_memory(model, parallel, hw, plan=Plan.of({"L31.qkv/L31.norm1_out": "R"}), stage=0)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("paired", [False, True])
def test_the_point_relation_is_x_minus_y_of_the_stage(pp, paired):
    """1F1B: a steady point is F_(y+w) B_y with w the stage's warmup forwards, so the DP's relation is w (at most
    3); a stage without points (the last of a plain pipeline, pp = 1 unpaired) reports 3."""
    parallel = ParallelConfig(pp=pp, num_microbatches=2 * pp + 4, paired=paired)
    for stage in range(pp):
        warmup = num_warmup(parallel, stage)
        pairs = [p for p in points(parallel, stage) if len(p) == 2]
        assert all(f.microbatch - b.microbatch == warmup for f, b in pairs)
        assert point_relation(parallel, stage) == (min(warmup, 3) if pairs else 3)


def test_a_warmup_forward_is_never_paired():
    """A point pairs only a forward after the stage's warmup: paired with m == pp every forward of stage 0 is
    warmup, so none pairs with a backward (that backward waits on a later stage that waits on this forward)."""
    for pp in range(2, 9):
        for paired in (False, True):
            for m in (pp, 2 * pp):
                parallel = ParallelConfig(pp=pp, num_microbatches=m, paired=paired)
                for stage in range(pp):
                    forwards = [a for a in schedule(parallel, stage) if a.kind == "F"]
                    for point in points(parallel, stage):
                        if len(point) == 2:
                            assert forwards.index(point[0]) >= num_warmup(parallel, stage)
        assert all(len(point) == 1 for point in points(ParallelConfig(pp=pp, num_microbatches=pp, paired=True), 0))


def test_memory_curve_entries_are_byte_counts():
    """An int of any integral type (numpy's too) or ``vp`` of them; anything else is one line naming the entry,
    never a ``TypeError`` nor a string read character by character."""
    import numpy as np

    parallel = ParallelConfig(pp=2, vp=2, num_microbatches=4)
    assert memory_curve(parallel, [np.int64(3)] * 4) == memory_curve(parallel, [3] * 4)
    assert memory_curve(parallel, [(np.int32(3), 3)] * 4) == memory_curve(parallel, [3] * 4)
    for bad in ("12", True, 1.5, None, (1.5, 2), (1, 2, 3), b"12"):
        with pytest.raises(ValueError, match="bytes of micro-batch 0 must be an int or 2 per-chunk ints"):
            memory_curve(parallel, [bad] * 4)


@given(pp=st.integers(1, 8), vp=st.integers(1, 4), k=st.integers(1, 4), paired=st.booleans(), data=st.data())
def test_inflight_chunks_and_the_peak_are_the_schedule_walked(pp, vp, k, paired, data):
    """The closed forms the large layouts take (no schedule built) agree with walking the schedule."""
    vp = 1 if pp == 1 else vp
    parallel = ParallelConfig(pp=pp, vp=vp, num_microbatches=k * pp, paired=paired)
    stage = data.draw(st.integers(0, pp - 1))
    held = peak = 0
    for action in schedule(parallel, stage):
        held += 1 if action.kind == "F" else -1
        peak = max(peak, held)
    assert inflight_chunks(parallel, stage) == peak
    per_microbatch = data.draw(st.lists(st.one_of(st.integers(0, 10**6), st.tuples(*[st.integers(0, 10**6)] * vp)),
                                        min_size=k * pp, max_size=k * pp))
    assert peak_bytes(parallel, per_microbatch, stage=stage) == max(memory_curve(parallel, per_microbatch,
                                                                                  stage=stage))


def test_the_largest_layout_in_bounds_is_counted_without_its_schedule():
    """pp=4, vp=256, 16,384 micro-batches (every bound at its largest): 8.4M actions a stage, walked once."""
    parallel = ParallelConfig(pp=4, vp=256, num_microbatches=16384)
    assert inflight_chunks(parallel, 0) == num_warmup(parallel, 0) + 1
    with pytest.raises(ValueError, match="per_microbatch_bytes must be a sequence of one entry per micro-batch"):
        memory_curve(parallel, 5)
    with pytest.raises(ValueError, match="parallel must be a ParallelConfig"):
        memory_curve(None, [1])
