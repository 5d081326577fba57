"""A digest of everything the runtime and the simulator decide, to compare two versions of the code.

    python benchmarks/behaviour.py > a.json      # on one version
    python benchmarks/behaviour.py > b.json      # on another
    cmp a.json b.json                            # identical decisions, kept bytes, orders and simulated times

It replays ``--traces`` spike traces (the paper's statistics, seeds 0..n-1) as consecutive iterations of one warm
decision path, for the first and the last stage of each Table II preset given, under both gates (graded and
paper), and records every forward's budget, decision, plan, kept bytes and fused makespan; then it simulates
every policy and ablation level over a paper trace of ``--iterations`` iterations and records each iteration.
Wall-clock fields (decision time, cache counters) are left out: they are not behaviour.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json

from bagualu2.costmodel import presets
from bagualu2.runtime import DecisionPath, replay_iteration, spike_trace
from bagualu2.sim import ABLATION, POLICIES, paper_trace, simulate

PRESETS = ("glm-188b-a20b", "glm-319b-a30b", "glm-423b-a30b", "glm-1041b-a35b")


def replays(name: str, num_traces: int) -> dict:
    model, parallel = presets.model(name)
    hardware = presets.hardware("paper-gpu")
    out = {}
    for stage in sorted({0, parallel.pp - 1}):
        for downgrade in ("graded", "paper"):
            path = DecisionPath(model, parallel, hardware, stage=stage, downgrade=downgrade)
            rows = []
            for seed in range(num_traces):
                trace = spike_trace(parallel.num_microbatches, base_imbalance=1.1, base_jitter=0.1, seed=seed)
                replay = replay_iteration(model, parallel, hardware, trace, path=path)
                rows.append({"peak": replay.peak_in_flight_bytes,
                             "decisions": [dataclasses.astuple(d) for d in replay.decisions]})
            out[f"stage{stage}-{downgrade}"] = rows
    return out


def simulations(name: str, num_iterations: int) -> dict:
    model, parallel = presets.model(name)
    hardware = presets.hardware("paper-gpu")
    trace = paper_trace(num_iterations, seed=3)
    out = {}
    for policy in POLICIES + ABLATION:
        result = simulate(model, parallel, hardware, policy, trace)
        out[policy] = [dataclasses.astuple(it) for it in result.iterations]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=int, default=30)
    parser.add_argument("--iterations", type=int, default=60)
    parser.add_argument("-m", "--model", action="append", help="a Table II preset (repeatable; default: four)")
    args = parser.parse_args()
    digest = {}
    for name in args.model or PRESETS:
        digest[name] = {"replay": replays(name, args.traces), "simulate": simulations(name, args.iterations)}
    text = json.dumps(digest, sort_keys=True)
    print(json.dumps({"sha256": hashlib.sha256(text.encode()).hexdigest(), "digest": digest}, sort_keys=True))


if __name__ == "__main__":
    main()
