"""The fusion DP against the simulator, the baselines and the exact CP-SAT schedule on random chains."""

import itertools
import math
import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bagualu2.costmodel import Resource
from bagualu2.fusion import Chain, Chains, Order, Stage, baselines, dp, exact, simulate
from bagualu2.fusion.interference import group_ns, makespan_ns

RESOURCE_OF = {"F": [Resource.COMPUTE, Resource.COMM], "B": [Resource.COMPUTE, Resource.COMM],
               "O": [Resource.D2H], "R": [Resource.H2D, Resource.COMPUTE, Resource.COMM]}


@st.composite
def random_chains(draw, max_stages=5, max_ns=1000):
    built = {}
    for kind in "FBOR":
        count = draw(st.integers(0, max_stages))
        if count == 0:
            built[kind] = None
            continue
        stages = tuple(Stage(f"{kind}{i}", draw(st.sampled_from(RESOURCE_OF[kind])), draw(st.integers(0, max_ns)))
                       for i in range(count))
        built[kind] = Chain(kind, stages)
    return Chains(built["F"], built["B"], built["O"], built["R"])


def _order_keeps_chains(order: Order, chains: Chains) -> None:
    seen = {k: [] for k in "FBOR"}
    for group in order.groups:
        for kind, index in group:
            seen[kind].append(index)
    for kind in "FBOR":
        chain = chains.get(kind)
        assert seen[kind] == list(range(len(chain) if chain else 0))


@given(random_chains())
def test_dp_keeps_chain_order_and_matches_simulation(chains):
    order = dp.solve(chains)
    _order_keeps_chains(order, chains)
    assert simulate(order, chains).makespan_ns == order.makespan_ns
    assert Order.from_str(repr(order)) == order
    assert chains.lower_bound_ns <= order.makespan_ns <= chains.sequential_ns


def _reference_dp(chains: Chains, share: float = 0.0) -> Order:
    """The DP of the paper written out state by state: every state, every one of the 15 masks in order; a mask
    wins only if strictly better, so ties go to the first mask (the vectorised DP must rebuild the same order).
    A group costs ``group_ns`` (its busiest resource; with ``share``, compute slowed beside communication)."""
    stages = [chains.get(k).stages if chains.get(k) else () for k in "FBOR"]
    shape = [len(s) + 1 for s in stages]
    states = list(itertools.product(*(range(n) for n in shape)))  # flat order: predecessors come first
    best, choice = {states[0]: 0}, {}
    for state in states[1:]:
        for mask in range(1, 16):
            advanced = [c for c in range(4) if (mask >> c) & 1]
            if any(state[c] == 0 for c in advanced):
                continue
            before = tuple(state[c] - ((mask >> c) & 1) for c in range(4))
            load: dict = {}
            for c in advanced:
                stage = stages[c][state[c] - 1]
                load[stage.resource] = load.get(stage.resource, 0) + stage.duration_ns
            value = best[before] + group_ns(load, share)
            if state not in best or value < best[state]:
                best[state], choice[state] = value, (mask, before)
    groups, state = [], states[-1]
    while state != states[0]:
        mask, before = choice[state]
        groups.append(tuple(("FBOR"[c], state[c] - 1) for c in range(4) if (mask >> c) & 1))
        state = before
    return Order(tuple(reversed(groups)), makespan_ns=best[states[-1]], solver="dp")


@given(st.one_of(random_chains(max_stages=4), random_chains(max_stages=4, max_ns=3)))  # small ns: many ties
def test_dp_matches_the_reference_recurrence_with_its_tie_breaks(chains):
    assert dp.solve(chains) == _reference_dp(chains)


@given(st.one_of(random_chains(max_stages=4), random_chains(max_stages=4, max_ns=3)),
       st.sampled_from([20 / 132, 0.3, 0.5]))
def test_dp_under_interference_matches_the_reference_and_never_loses_to_a_baseline(chains, share):
    """With compute slowed beside communication the DP is still the recurrence's optimum over barrier orders
    (the slowdown is a function of each group's loads), its makespan is the interference's, and no baseline
    order is faster under the same slowdown."""
    order = dp.solve(chains, share=share)
    assert order == _reference_dp(chains, share)
    assert order.makespan_ns == makespan_ns(order, chains, share)
    assert makespan_ns(dp.solve(chains), chains, share) >= order.makespan_ns
    for name, baseline in baselines.BASELINES.items():
        assert order.makespan_ns <= makespan_ns(baseline(chains), chains, share), name


def test_interference_share_is_checked():
    chains = Chains(Chain("F", (Stage("F0", Resource.COMPUTE, 5),)), None, None, None)
    for bad in (-0.1, 1.0, True, "0.1", float("nan")):
        with pytest.raises(ValueError, match="share must be a number in"):
            dp.solve(chains, share=bad)


@given(random_chains())
def test_dp_never_loses_to_a_baseline(chains):
    order = dp.solve(chains)
    for name, baseline in baselines.BASELINES.items():
        other = baseline(chains)
        _order_keeps_chains(other, chains)
        assert order.makespan_ns <= other.makespan_ns, name


@given(random_chains(max_stages=4))
def test_exact_is_a_lower_bound_of_the_dp(chains):
    order = dp.solve(chains)
    best = exact.solve(chains, time_limit_s=20, hint=order)
    assert best.solver == "exact"
    assert chains.lower_bound_ns <= best.makespan_ns <= order.makespan_ns
    assert simulate(best, chains).makespan_ns == best.makespan_ns
    assert Order.from_str(repr(best)) == best


@given(random_chains(), st.randoms(use_true_random=False))
def test_any_valid_interleaving_simulates_and_dp_is_no_worse(chains, rng):
    remaining = {k: list(range(len(chains.get(k)))) if chains.get(k) else [] for k in "FBOR"}
    groups = []
    while any(remaining.values()):
        kinds = [k for k in "FBOR" if remaining[k]]
        chosen = rng.sample(kinds, rng.randint(1, len(kinds)))
        groups.append(tuple((k, remaining[k].pop(0)) for k in chosen))
    order = Order(tuple(groups))
    assert dp.solve(chains).makespan_ns <= simulate(order, chains).makespan_ns


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="empty"):
        Chain("F", ())
    with pytest.raises(ValueError, match="resource"):
        Stage("x", "gpu", 1)
    with pytest.raises(ValueError, match="duration"):
        Stage("x", Resource.COMPUTE, -1)
    with pytest.raises(ValueError, match="kind"):
        Chain("X", (Stage("x", Resource.COMPUTE, 1),))
    chains = Chains(Chain("F", (Stage("a", Resource.COMPUTE, 1), Stage("b", Resource.COMM, 2))))
    with pytest.raises(ValueError, match="chain order"):
        simulate(Order(((("F", 1),), (("F", 0),))), chains)
    with pytest.raises(ValueError, match="missing"):
        simulate(Order(((("F", 0),),)), chains)
    with pytest.raises(ValueError):
        Order.from_str("F0+F1")
    with pytest.raises(ValueError):
        Order.from_str("X3")


def test_at_pipeline_degree_one_the_copies_run_beside_their_own_forward_and_backward():
    """x - y = 1 (combined 1F1B without a pipeline): F and B are ordered by the DP, no warning; the copies are F's
    and B's own and run beside them on the copy engines."""
    chains = Chains(Chain("F", (Stage("a", Resource.COMPUTE, 5),)), Chain("B", (Stage("b", Resource.COMM, 5),)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        order = dp.solve(chains, pipeline_degree=1)
    assert order.makespan_ns == 5 == dp.solve(chains, pipeline_degree=4).makespan_ns
    copies = Chains(chains.forward, chains.backward, Chain("O", (Stage("o", Resource.D2H, 3),)),
                    Chain("R", (Stage("r", Resource.H2D, 2), Stage("re", Resource.COMPUTE, 4))))
    order = dp.solve(copies, pipeline_degree=1)
    # the reload before the backward reads it, the copy out once F has made it: nothing overlaps with one stage each
    assert str(order) == "R0|F0+B0|O0|R1" and order.makespan_ns == 2 + 5 + 3 + 4
    longer = Chains(Chain("F", (Stage("a", Resource.COMPUTE, 5), Stage("c", Resource.COMPUTE, 5))),
                    Chain("B", (Stage("b", Resource.COMPUTE, 5), Stage("d", Resource.COMPUTE, 5))), copies.offload,
                    Chain("R", (Stage("r", Resource.H2D, 2),)))
    order = dp.solve(longer, pipeline_degree=1)
    assert order.makespan_ns == 20  # the copies hidden beside compute, each where its data allow
    _copies_follow_their_data(order, longer)


def _copies_follow_their_data(order: Order, chains: Chains) -> None:
    """At degree 1: copy-out piece k after the group of the F stage completing (k+1)/n of F; reload k before the
    group of B stage floor(k |B| / h)."""
    group_of = {ref: g for g, group in enumerate(order.groups) for ref in group}
    forward, backward = (len(c) if c else 0 for c in (chains.forward, chains.backward))
    offload = len(chains.offload) if chains.offload else 0
    for k in range(offload if forward else 0):
        assert group_of[("O", k)] > group_of[("F", -(-(k + 1) * forward // offload) - 1)]
    reloads = 0
    while chains.recovery and reloads < len(chains.recovery) and chains.recovery.stages[reloads].resource is \
            Resource.H2D:
        reloads += 1
    for k in range(reloads if backward else 0):
        assert group_of[("R", k)] < group_of[("B", k * backward // reloads)]


@given(random_chains())
def test_at_pipeline_degree_one_the_order_is_no_slower_than_megatron_or_copies_after(chains):
    """Degree 1's order keeps every chain's order, runs each copy after the data it copies and each reload before
    the backward stage that reads it, is timed as the simulator times it, and is no slower than Megatron-Core's
    execution of the same own copies (paired or not) or the DP's F and B with the copies after them."""
    order = dp.solve(chains, pipeline_degree=1)
    _order_keeps_chains(order, chains)
    assert simulate(order, chains).makespan_ns == order.makespan_ns <= chains.sequential_ns
    if chains.offload is None and chains.recovery is None:
        assert order == dp.solve(chains)
        return
    for pair in (True, False):
        assert order.makespan_ns <= baselines.megatron_overlapped(chains, pair=pair, own=True).makespan_ns
    _copies_follow_their_data(order, chains)
    core = dp.solve(Chains(chains.forward, chains.backward)).groups if chains.forward or chains.backward else ()
    after = Order(core + tuple(((c.kind, i),) for c in (chains.offload, chains.recovery) if c is not None
                               for i in range(len(c))))
    assert order.makespan_ns <= simulate(after, chains).makespan_ns


@given(random_chains())
def test_at_pipeline_degree_two_f_and_b_interleave_and_the_copies_sit_at_the_edges(chains):
    """x - y = 2: O (of x-1) and R (of y+1) copy the same micro-batch. F and B keep the DP's order of the two,
    every O stage comes before every R stage, the order is valid and no slower than running it in series; no
    warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        order = dp.solve(chains, pipeline_degree=2)
    _order_keeps_chains(order, chains)
    assert simulate(order, chains).makespan_ns == order.makespan_ns <= chains.sequential_ns
    if chains.offload is None or chains.recovery is None:
        assert order == dp.solve(chains)  # no shared micro-batch: the full DP
        return
    stages = [stage for group in order.groups for stage in group]
    last_out = max(i for i, (kind, _) in enumerate(stages) if kind == "O")
    first_back = min(i for i, (kind, _) in enumerate(stages) if kind == "R")
    groups_of = {stage: g for g, group in enumerate(order.groups) for stage in group}
    assert max(groups_of[("O", i)] for i in range(len(chains.offload))) < min(
        groups_of[("R", i)] for i in range(len(chains.recovery))) and last_out < first_back
    if chains.forward is not None or chains.backward is not None:
        core = dp.solve(Chains(chains.forward, chains.backward))
        kept = tuple(tuple(s for s in group if s[0] in "FB") for group in order.groups)
        assert tuple(g for g in kept if g) == core.groups


def test_pipeline_degree_two_overlaps_the_copies_with_compute():
    compute = lambda name, ns: Stage(name, Resource.COMPUTE, ns)  # noqa: E731
    chains = Chains(Chain("F", (compute("f0", 10), Stage("f1", Resource.COMM, 10), compute("f2", 10))),
                    Chain("B", (compute("b0", 10), Stage("b1", Resource.COMM, 10), compute("b2", 10))),
                    Chain("O", (Stage("o0", Resource.D2H, 10),)), Chain("R", (Stage("r0", Resource.H2D, 10),)))
    order = dp.solve(chains, pipeline_degree=2)
    assert ("O", 0) in order.groups[0] and ("R", 0) in order.groups[-1]  # out at the start, back at the end
    assert order.makespan_ns < baselines.sequential(chains).makespan_ns  # F's comm under B's compute, copies hidden


def test_warmup_and_cooldown_points():
    forward_only = Chains(Chain("F", (Stage("a", Resource.COMPUTE, 3), Stage("b", Resource.COMM, 4))),
                          offload=Chain("O", (Stage("o", Resource.D2H, 4),)))
    assert dp.solve(forward_only).makespan_ns == 7
    assert dp.solve(Chains()).makespan_ns == 0


@given(random_chains(), st.sampled_from([0.0, 20 / 132]))
def test_chains_over_the_table_bound_are_ordered_in_two_steps_and_never_lose_to_a_baseline(chains, share):
    """Past ``MAX_STATES`` (here lowered so that small chains cross it) the order is F and B by the DP with the
    copies beside them or at the edges, or a baseline's: valid, timed right, no better than the one-table DP and no
    worse than any baseline."""
    optimum = dp.solve(chains, share=share)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dp, "MAX_STATES", 6)
        order = dp.solve(chains, share=share)
    _order_keeps_chains(order, chains)
    assert order.makespan_ns == (makespan_ns(order, chains, share) if share else simulate(order, chains).makespan_ns)
    assert optimum.makespan_ns <= order.makespan_ns <= chains.sequential_ns
    for name, baseline in baselines.BASELINES.items():
        assert order.makespan_ns <= makespan_ns(baseline(chains), chains, share), name


def test_long_chains_never_build_a_table_past_the_bound():
    """A 50-layer chunk's point (201 F and B stages, 16 copy pieces each way: 11.7 million states) is ordered
    without building its table: F and B alone (40,804 states) by the DP."""
    def chain(kind, resources, count):
        return Chain(kind, tuple(Stage(f"{kind}{i}", resources[i % len(resources)], 100 + (i * 37) % 50)
                                 for i in range(count)))

    compute_comm = (Resource.COMPUTE, Resource.COMM)
    chains = Chains(chain("F", compute_comm, 201), chain("B", compute_comm, 201), chain("O", (Resource.D2H,), 16),
                    chain("R", (Resource.H2D,) * 8 + (Resource.COMPUTE,), 16))
    built = []
    make = dp._levels.make
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dp._levels, "make", lambda shape: built.append(shape) or make(shape))
        order = dp.solve(chains, share=20 / 132)
    assert built and all(math.prod(shape) <= dp.MAX_STATES for shape in built)
    _order_keeps_chains(order, chains)
    assert order.makespan_ns == makespan_ns(order, chains, 20 / 132)


def test_the_layout_cache_holds_a_bounded_number_of_states():
    cache = dp._ShapeCache(lambda shape: math.prod(shape))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dp, "CACHED_STATES", 100)
        for shape in [(5, 5, 2, 1), (4, 4, 2, 1), (3, 3, 3, 1), (5, 5, 2, 1)]:  # 50 + 32 + 27: the first goes
            assert cache(shape) == math.prod(shape)
    assert cache.states == 77 and list(cache.entries) == [(3, 3, 3, 1), (5, 5, 2, 1)]
