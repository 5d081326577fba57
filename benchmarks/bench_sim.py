"""Simulator speed: 100,000 iterations of GLM-423B-A30B on the paper trace under one policy (the issue's target:
well under 60 s), memoised by (policy in force, the iteration's rates)."""

import pytest

from bagualu2.costmodel import presets
from bagualu2.sim import paper_trace, simulate

MODEL, PARALLEL = presets.model("glm-423b-a30b")
HW = presets.hardware("paper-gpu")
TRACE = paper_trace(100_000, seed=0)


@pytest.mark.parametrize("policy", ["flexible", "static-under"])
def test_simulate_100k_iterations(benchmark, policy):
    result = benchmark.pedantic(simulate, args=(MODEL, PARALLEL, HW, policy, TRACE), rounds=1, iterations=1)
    assert len(result.iterations) == 100_000
    benchmark.extra_info.update(result.summary())
