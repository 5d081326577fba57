"""Fusion speed: the DP of one GLM-1041B-A35B scheduling point, a memo hit of the stage's order function
(``runtime.Stage.order``), and the whole decision path of one iteration replayed over a 100-iteration spike trace."""

import gc

import pytest

from bagualu2.costmodel import build_graph, presets
from bagualu2.fusion import build_chains, dp
from bagualu2.mitigation import greedy
from bagualu2.runtime import DecisionPath, Stage, replay_iteration, spike_trace

MODEL, PARALLEL = presets.model("glm-1041b-a35b")
HW = presets.hardware("paper-gpu")


def _chains(step):
    graph = build_graph(MODEL, PARALLEL, HW, imbalance=1.6)
    budget = graph.floor_bytes + (graph.unmitigated_bytes - graph.floor_bytes) * step // 4
    plan = greedy.solve(graph, budget).plan
    return build_chains(graph, plan, graph, plan, hardware=HW)


@pytest.mark.parametrize("step", [1, 2, 3])
def test_dp_scheduling_point(benchmark, step):
    chains = _chains(step)
    order = benchmark(dp.solve, chains)
    assert order.makespan_ns <= chains.sequential_ns
    benchmark.extra_info["stages"] = chains.counts()


def test_order_memo_hit(benchmark):
    """``Stage.order`` of the same chains again: the key (each chain's stage resources and durations) and a lookup
    in the stage's memo."""
    chains = _chains(2)
    engine = Stage(MODEL, PARALLEL, HW, stage=0)
    first = engine.order(chains)
    assert benchmark(engine.order, chains) is first and first.makespan_ns > 0


def _collect_garbage():
    gc.collect()


@pytest.mark.parametrize("downgrade", ["graded", "paper"])
def test_decision_path_per_iteration(benchmark, downgrade):
    """Budget + pre-gate plan + gate decision + fused order for every forward of stage 0, amortised over 100
    iterations of a trace with 2.9% spikes up to 2.6x (first iterations fill the caches); ``paper``: the gate only
    keeps or fully downgrades (no absorption, no re-plan)."""
    trace = spike_trace(100 * PARALLEL.num_microbatches, spike_rate=0.029, max_imbalance=2.6, seed=0)

    def hundred_iterations():
        path = DecisionPath(MODEL, PARALLEL, HW, downgrade=downgrade)
        times = []
        for it in range(100):
            window = trace[it * PARALLEL.num_microbatches:(it + 1) * PARALLEL.num_microbatches]
            replay = replay_iteration(MODEL, PARALLEL, HW, window, path=path)
            assert replay.fits
            times.append(replay.decision_time_s)
        return sum(times) / 100, sorted(times)[50], path

    # a full collection pending from earlier benchmarks' garbage must not land in the timed run: collect first;
    # three rounds (fresh caches each), the median reported (this machine switches between two speeds)
    rounds = []
    benchmark.pedantic(lambda: rounds.append(hundred_iterations()), setup=_collect_garbage, rounds=3, iterations=1)
    per_iteration_s, median_s, path = sorted(rounds, key=lambda r: r[0])[1]
    benchmark.extra_info["amortised_ms_per_iteration"] = per_iteration_s * 1e3
    benchmark.extra_info["amortised_ms_per_iteration_rounds"] = [round(r[0] * 1e3, 3) for r in rounds]
    benchmark.extra_info["median_iteration_ms"] = median_s * 1e3
    benchmark.extra_info["decision_cache"] = f"{path.hits} hits / {path.misses} misses"
    print(f"\namortised decision path ({downgrade}): {per_iteration_s * 1e3:.2f} ms/iteration (median of 3 rounds: "
          f"{', '.join(f'{r[0] * 1e3:.2f}' for r in rounds)}), median iteration {median_s * 1e3:.2f} ms "
          f"({path.hits} hits, {path.misses} misses)")
