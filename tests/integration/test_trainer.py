"""The distributed reference trainer under torchrun on CPU/gloo (``glm_moe_debug``, a few steps each).

* PP=2 x DP=2 (EP=2), two virtual stages per rank, through the runtime schedule, the same through
  ``--schedule plain`` and one process with the same global batch agree (plain: bitwise; one process: 1e-5 relative
  in fp32);
* PP=1 x DP=2 (EP=2): the runtime schedule pairs F_(i+1) with B_i (combined 1F1B), bitwise the plain schedule;
  PP=2 x DP=2 with ``--paired`` pairs every steady point, the last stage's too, bitwise the plain schedule;
  the baselines run their points in Megatron-Core's combined-1F1B order, flexible in the fusion DP's;
* PP=4 x DP=1 runs fused OVERLAP_F_B points with O and R (pipeline degree > 2), every micro-batch keeps the bytes
  the cost model predicts for its plan, and the loss falls;
* (killed, stopped and corrupted runs: tests/integration/test_faults.py)
* two torchrun launchers (``--nnodes=2``) rendezvous on 127.0.0.1 and train;
* a bad flag: one line from rank 0, exit code 2, no traceback from the trainer; nodes launched with different
  flags, or with a bad flag on one node only: one line from rank 0 naming the rank and the flag;
* ``kill -9`` of the launcher: its workers die with it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from forkrun import FORKRUN, forked

pytestmark = [pytest.mark.integration, pytest.mark.launch]

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
# torchrun's elastic agent with forked workers (forkrun.py), itself forked from a fork server that imported torch once:
# the trainer from main() on; the two-node rendezvous below runs the torchrun executable itself
TIMEOUT_S = 240
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "BAGUALU2_CHECK_COLLECTIVES": "1"}  # every run checks its collective order


def torchrun(nproc: int, *args: str, launcher: tuple[str, ...] = ("--standalone",)) -> subprocess.CompletedProcess:
    return forked(FORKRUN, *launcher, f"--nproc_per_node={nproc}", "-m", "reference_trainer.train", *args, cwd=ROOT,
                  env=ENV, timeout=TIMEOUT_S)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records(path) if not r.get("summary")]


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]


@pytest.fixture(scope="module")
def equivalence(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("equivalence")
    runtime, plain, single = tmp / "runtime.jsonl", tmp / "plain.jsonl", tmp / "single.jsonl"
    ok(torchrun(4, "--steps", "3", "--vp", "2", "--metrics-file", str(runtime)))
    ok(torchrun(4, "--steps", "3", "--vp", "2", "--schedule", "plain", "--metrics-file", str(plain)))
    proc = forked("-m", "reference_trainer.train", "--steps", "3", "--pp", "1", "--dp", "1", "--ep", "1",
                  "--num-microbatches", "8", "--metrics-file", str(single), cwd=ROOT, env=ENV, timeout=TIMEOUT_S)
    ok(proc)
    return runtime, plain, single


def test_pp2_dp2_vp2_runtime_matches_one_process_and_the_plain_schedule(equivalence):
    runtime, plain, single = equivalence
    distributed, stock, alone = losses(runtime), losses(plain), losses(single)
    assert [s for s, _ in distributed] == list(range(3))
    for (_, a), (_, b) in zip(distributed, alone):
        assert abs(a - b) <= 1e-5 * abs(b)
    plans = {mb["plan"] for r in records(runtime) + records(plain) if not r.get("summary") for mb in r["microbatches"]}
    assert not any("quantize" in p for p in plans), plans  # recompute and offload only: bitwise
    assert distributed == stock


def test_pp2_dp2_vp2_keeps_the_predicted_bytes_within_the_cap(equivalence):
    runtime = records(equivalence[0])
    summary = runtime[-1]
    assert summary["summary"] and summary["peak_activation_bytes"] <= summary["memory_cap_bytes"]
    steps = [r for r in runtime if not r.get("summary")]
    micro = [mb for r in steps for mb in r["microbatches"]]
    assert len(micro) == 3 * 4 * 4 * 2  # steps x (2 stages x 2 replicas) x 4 micro-batches x 2 virtual stages
    assert {mb["chunk"] for mb in micro} == {0, 1}
    assert all(mb["kept_bytes"] == mb["predicted_bytes"] for mb in micro)
    assert any(mb["plan"] != "none" for mb in micro)  # the cap makes the runtime mitigate
    assert all(len(mb["imbalance"]) >= 1 for mb in micro if mb["stage"] == 1)  # MoE layers report their gates
    assert all(r["order"] for r in steps)  # fused points of the interleaved action list ran


def test_pp4_fused_points_with_offload_and_recovery(tmp_path):
    metrics = tmp_path / "pp4.jsonl"
    ok(torchrun(4, "--steps", "12", "--pp", "4", "--dp", "1", "--ep", "1", "--num-microbatches", "8",
                "--metrics-file", str(metrics)))
    steps = [r for r in records(metrics) if not r.get("summary")]
    micro = [mb for r in steps for mb in r["microbatches"]]
    assert all(mb["kept_bytes"] == mb["predicted_bytes"] for mb in micro)
    orders = [o for r in steps for o in r["order"]]
    assert orders and any("O" in o.split(": ")[1] for o in orders) and any("R" in o.split(": ")[1] for o in orders)
    first, last = steps[0]["loss"], sum(r["loss"] for r in steps[-3:]) / 3
    assert last < first - 0.5
    assert records(metrics)[-1]["planning_fraction"] < 0.05  # benchmarks/ measures it on 50 steps


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_node_rendezvous_on_localhost(tmp_path):
    port = _free_port()
    metrics = tmp_path / "nodes.jsonl"
    common = [str(TORCHRUN), "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bagualu2-test", "-m", "reference_trainer.train",
              "--steps", "3", "--pp", "2", "--dp", "1", "--ep", "1", "--metrics-file", str(metrics)]
    nodes = [subprocess.Popen(common[:1] + [f"--node-rank={rank}"] + common[1:], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [node.communicate(timeout=TIMEOUT_S) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert [s for s, _ in losses(metrics)] == [0, 1, 2]
    assert records(metrics)[-1]["layout"] == {"pp": 2, "dp": 1, "ep": 1, "vp": 1}


def _two_nodes(flags: tuple[list[str], list[str]]) -> list[tuple[int, str]]:
    """Two torchrun launchers of one rank each on 127.0.0.1, node ``i`` with ``flags[i]``: (exit code, stderr)."""
    port = _free_port()
    common = [str(TORCHRUN), "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
              f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=bagualu2-flags", "-m", "reference_trainer.train",
              "--steps", "2", "--pp", "2", "--dp", "1", "--ep", "1"]
    nodes = [subprocess.Popen(common[:1] + [f"--node-rank={rank}"] + common[1:] + flags[rank], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    return [(node.returncode, err) for node, (_, err) in zip(nodes, [n.communicate(timeout=TIMEOUT_S) for n in nodes])]


@pytest.mark.parametrize("flags, message", [
    ((["--seed", "1"], ["--seed", "2"]), "error: the ranks were launched with different flags: --seed is 1 on rank 0 "
                                         "and 2 on rank 1"),
    (([], ["--memory-cap", "1KiB"]), "error: rank 1: --memory-cap must be at least"),
])
def test_nodes_launched_with_different_or_bad_flags_stop_in_one_line_from_rank_0(flags, message):
    """Before any collective: every rank publishes its flags (or its error) in the launch's store and all agree."""
    (code0, err0), (code1, err1) = _two_nodes(flags)
    assert code0 != 0 and code1 != 0, err0[-3000:] + err1[-3000:]
    lines = [line for line in (err0 + err1).splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(message), err0[-3000:] + err1[-3000:]
    assert "reference_trainer/" not in err0 + err1  # no traceback through the trainer's code


def test_the_workers_of_a_killed_launcher_stop(tmp_path):
    """``kill -9`` of torchrun's agent: its workers die with it (no orphan keeps training or waiting)."""
    import time

    metrics = tmp_path / "orphans.jsonl"  # a unique path: how this launch's processes are found
    agent = subprocess.Popen([str(TORCHRUN), "--standalone", "--nproc_per_node=2", "-m", "reference_trainer.train",
                              "--steps", "500", "--pp", "2", "--dp", "1", "--ep", "1", "--metrics-file", str(metrics)],
                             cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def running() -> list[str]:
        found = subprocess.run(["pgrep", "-f", str(metrics)], capture_output=True, text=True).stdout.split()
        return [pid for pid in found if int(pid) != agent.pid]

    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (metrics.exists() and metrics.read_text()) and time.monotonic() < deadline:
            time.sleep(0.5)  # until the first step is logged: the workers are training
        assert len(running()) == 2
        agent.kill()
        agent.wait()
        deadline = time.monotonic() + 30
        while running() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not running()
    finally:  # a failure leaves no process of this launch on the machine
        agent.kill()
        for pid in running():
            subprocess.run(["kill", "-9", pid], capture_output=True)


def test_a_bad_flag_is_one_line_from_rank_0_and_the_others_exit_quietly():
    """Under torchrun (the flag errors themselves are checked in-process: tests/unit/test_cli_train.py)."""
    proc = torchrun(2, "--steps", "1", "--pp", "2", "--dp", "1", "--ep", "1", "--memory-cap", "1KiB")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--memory-cap must be at least" in errors[0], proc.stderr[-3000:]
    assert "reference_trainer/" not in proc.stderr  # no traceback through the trainer's code on any rank


def test_static_under_runs_out_of_memory_is_restarted_by_torchrun_and_continues_as_static_over(tmp_path):
    """...and stays static-over through a later restart (a rank killed in the restarted launch)."""
    metrics, ckpt = tmp_path / "under.jsonl", tmp_path / "ckpt"
    proc = forked(FORKRUN, "--standalone", "--nproc_per_node=2", "--max-restarts", "2", "-m",
                  "reference_trainer.train", "--pp", "1", "--dp", "2", "--ep", "2", "--policy", "static-under",
                  "--steps", "4", "--spike-rate", "0.5", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
                  "--metrics-file", str(metrics), "--schedule", "plain", cwd=ROOT,
                  env={**ENV, "BAGUALU2_FAULTS": "kill@3:rank=1:launch=1"}, timeout=TIMEOUT_S)
    ok(proc)
    assert "ran out of activation memory" in proc.stderr and "exitcode: 75" in proc.stderr
    assert proc.stderr.count("ran out of activation memory") == 1, proc.stderr[-4000:]
    rows = records(metrics)
    summary = rows[-1]
    assert summary["oom_events"] == 1 and summary["restarts"] == 2 and summary["restart_s"] > 0
    assert summary["policies"] == ["static-under", "static-over"] and summary["policy"] == "static-over"
    oom = next(r for r in rows if r.get("oom") is True)
    assert oom["continues_as"] == "static-over"
    before = [r["peak_activation_bytes"] for r in rows if "loss" in r and r["step"] < oom["resumed_from_step"]]
    assert oom["peak_activation_bytes"] <= max(before, default=0)  # the failed ranks' share of those steps
    assert oom["peak_activation_bytes"] > 0 or not before
    assert [r["step"] for r in rows if "loss" in r][-1] == 3


def test_pp1_dp2_runtime_pairs_f_and_b_and_matches_the_plain_schedule_bitwise(tmp_path):
    """No pipeline, EP=2: the runtime schedule runs every F_(i+1) B_i as a fused point (combined 1F1B, two
    micro-batches in flight, all-to-alls of one beside the other's compute); the losses are bitwise the plain
    schedule's (F_i then B_i), every micro-batch keeps what the cost model predicts, the collective checker is on."""
    runs = {}
    for schedule in ("runtime", "plain"):
        runs[schedule] = tmp_path / f"{schedule}.jsonl"
        ok(torchrun(2, "--steps", "3", "--pp", "1", "--dp", "2", "--ep", "2", "--schedule", schedule,
                    "--metrics-file", str(runs[schedule])))
    assert losses(runs["runtime"]) == losses(runs["plain"]) and len(losses(runs["plain"])) == 3
    steps = [r for r in records(runs["runtime"]) if not r.get("summary")]
    for record in steps:
        points = [point.split(":")[0] for point in record["order"]]  # both ranks' points
        assert points == [f"Fc0.m{i + 1} Bc0.m{i}" for i in range(3)] * 2
        assert any("+" in point for point in record["order"])  # F and B stages share groups
        assert all(mb["kept_bytes"] == mb["predicted_bytes"] for mb in record["microbatches"])
    summary = records(runs["runtime"])[-1]
    assert summary["peak_activation_bytes"] <= summary["memory_cap_bytes"]
    assert summary["memory_cap_bytes"] > records(runs["plain"])[-1]["memory_cap_bytes"]  # two in flight, not one
    single = tmp_path / "single.jsonl"  # one micro-batch: F0 then B0, nothing to pair
    ok(torchrun(2, "--steps", "1", "--pp", "1", "--dp", "2", "--ep", "2", "--num-microbatches", "1",
                "--metrics-file", str(single)))
    assert records(single)[0]["order"] == [] and len(losses(single)) == 1


def test_pp2_paired_pairs_the_last_stage_too_and_matches_the_plain_schedule_bitwise(tmp_path):
    """PP=2 x DP=2 (EP=2), ``--paired`` (Megatron-Core's combined 1F1B): one more warmup forward per stage, so the
    last stage runs F_(i+1) beside B_i too and stage 0 pairs F_(i+2) with B_i; the losses are bitwise the plain
    schedule's, every micro-batch keeps what the cost model predicts, within a cap that counts one more chunk in
    flight; the collective checker is on."""
    runs = {}
    for name, flags in (("paired", ("--paired",)), ("unpaired", ()), ("plain", ("--schedule", "plain"))):
        runs[name] = tmp_path / f"{name}.jsonl"
        ok(torchrun(4, "--steps", "2", *flags, "--metrics-file", str(runs[name])))
    assert losses(runs["paired"]) == losses(runs["plain"]) == losses(runs["unpaired"])
    for record in (r for r in records(runs["paired"]) if not r.get("summary")):
        points = sorted(point.split(":")[0] for point in record["order"])  # all ranks' points
        last = [f"Fc0.m{i + 1} Bc0.m{i}" for i in range(3)] * 2  # the two replicas of stage 1
        first = [f"Fc0.m{i + 2} Bc0.m{i}" for i in range(2)] * 2
        assert points == sorted(first + last)
        assert all(mb["kept_bytes"] == mb["predicted_bytes"] for mb in record["microbatches"])
    summary, unpaired = records(runs["paired"])[-1], records(runs["unpaired"])[-1]
    assert summary["peak_activation_bytes"] <= summary["memory_cap_bytes"]
    assert summary["memory_cap_bytes"] > unpaired["memory_cap_bytes"]  # three chunks in flight on stage 0, not two


def test_baselines_run_megatron_cores_combined_1f1b_order_bitwise_the_plain_schedule(tmp_path):
    """Under the runtime schedule a baseline runs its fused points as its real system would (Megatron-Core's
    combined 1F1B): kwai (its search offloads here; no all-to-all re-run) pairs one forward stage with one
    backward stage in program order; static-over (full recompute re-runs dispatch and combine inside B) runs F then
    B, never paired. Losses bitwise the plain schedule's; the collective checker is on."""
    for policy in ("kwai", "static-over"):
        runs = {}
        for schedule in ("runtime", "plain"):
            runs[schedule] = tmp_path / f"{policy}-{schedule}.jsonl"
            ok(torchrun(2, "--steps", "2", "--pp", "1", "--dp", "2", "--ep", "2", "--policy", policy,
                        "--schedule", schedule, "--spike-rate", "0", "--metrics-file", str(runs[schedule])))
        assert losses(runs["runtime"]) == losses(runs["plain"])
        orders = [point.split(": ")[1] for r in records(runs["runtime"])[:-1] for point in r["order"]]
        assert orders
        for order in orders:
            groups = [group.split("+") for group in order.split("|")]
            forwards = [int(ref[1:]) for group in groups for ref in group if ref[0] == "F"]
            backwards = [int(ref[1:]) for group in groups for ref in group if ref[0] == "B"]
            assert forwards == sorted(forwards) and backwards == sorted(backwards)  # each chain in program order
            paired = [group for group in groups if {ref[0] for ref in group} >= {"F", "B"}]
            if policy == "kwai":  # Megatron's fixed pairing: F_(j+k) beside B_j, one stage each, in step
                ordered = (sorted(group, key=lambda ref: "FB".index(ref[0])) for group in paired)
                offsets = {int(f[1:]) - int(b[1:]) for f, b in ordered}
                assert paired and all(len(group) == 2 for group in paired) and len(offsets) == 1
                first = groups.index(paired[0])
                assert groups[first:first + len(paired)] == paired  # one run of pairs, singles only around it
            else:
                kinds = [group[0][0] for group in groups]
                assert not paired and kinds == sorted(kinds, key="FB".index)  # every F stage, then every B stage


def test_flexible_safety_net_reruns_a_mispredicted_micro_batch_without_a_restart(tmp_path):
    metrics = tmp_path / "net.jsonl"
    ok(torchrun(2, "--steps", "3", "--pp", "1", "--dp", "2", "--ep", "2", "--prediction-scale", "0.6",
                "--metrics-file", str(metrics)))  # paired: an overflow while B_y still held its bytes counts
    rows = records(metrics)
    summary = rows[-1]
    assert summary["oom_events"] == 0 and summary["restarts"] == 0 and summary["reruns"] > 0
    reruns = [mb for r in rows[:-1] for mb in r["microbatches"] if mb["action"] == "rerun"]
    assert len(reruns) == summary["reruns"] and all(mb["kept_bytes"] == mb["predicted_bytes"] for mb in reruns)


def test_ideal_runs_uncapped_and_kwai_adapipe_fixed_plans(tmp_path):
    for policy in ("ideal", "kwai"):
        metrics = tmp_path / f"{policy}.jsonl"
        ok(torchrun(2, "--steps", "2", "--pp", "2", "--dp", "1", "--ep", "1", "--policy", policy, "--schedule",
                    "plain", "--metrics-file", str(metrics)))
        micro = [mb for r in records(metrics)[:-1] for mb in r["microbatches"]]
        assert all(mb["kept_bytes"] == mb["predicted_bytes"] for mb in micro)
        plans = {mb["plan"] for mb in micro}
        assert (plans == {"none"}) == (policy == "ideal"), plans
