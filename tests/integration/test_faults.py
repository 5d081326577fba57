"""Faults real clusters have, injected into the reference trainer under torchrun on CPU/gloo (``BAGUALU2_FAULTS``),
each run compared with an uninterrupted run of the same seed: after recovery the losses are bitwise equal.

* SIGKILL of one rank mid-step, and of a rank while it writes a checkpoint (the partial one is never loaded); a
  corrupted newest checkpoint is refused and the previous one used;
* SIGSTOP of one rank (a hang): the others' watchdog / collective timeout ends the launch within
  ``--collective-timeout``, torchrun restarts it, it resumes from the last complete checkpoint;
* a diverged collective order is caught by ``BAGUALU2_CHECK_COLLECTIVES`` in one line;
* a non-finite gradient: ``--on-nonfinite stop`` (one line, the last good checkpoint intact) and ``skip``;
* a checkpoint write that fails (ENOSPC, EACCES): one warning line naming the path and the cause, training goes on;
* a defect (an exception from a forward): its traceback and exit code 1, never an abort.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from forkrun import FORKRUN, forked

from reference_trainer.experiments.chaos import has_traceback

pytestmark = [pytest.mark.integration, pytest.mark.launch]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "BAGUALU2_CHECK_COLLECTIVES": "1"}  # every run checks its collective order
# two ranks, one pipeline of two stages (p2p, fused points, a checkpoint shard per stage); expert parallelism, spikes
# and the collective checker across an EP group are the non-finite and divergence cases' layout (PP1 x DP2, EP2)
COMMON = ["--steps", "5", "--seed", "11", "--pp", "2", "--dp", "1", "--ep", "1"]


def launch(nproc: int, *args: str, faults: str = "", restarts: int = 0) -> subprocess.CompletedProcess:
    return forked(FORKRUN, "--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={restarts}",
                  "--monitor-interval=0.2", "-m", "reference_trainer.train", *args, cwd=ROOT,
                  env={**ENV, "BAGUALU2_FAULTS": faults}, timeout=TIMEOUT_S)


def alone(*args: str, faults: str = "") -> subprocess.CompletedProcess:
    return forked("-m", "reference_trainer.train", "--pp", "1", "--dp", "1", "--ep", "1", *args, cwd=ROOT,
                  env={**ENV, "BAGUALU2_FAULTS": faults}, timeout=TIMEOUT_S)


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def losses(path: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in records(path) if "loss" in r and not r.get("summary")]


def ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]


def errors(proc: subprocess.CompletedProcess, prefix: str = "error:") -> list[str]:
    return [line for line in proc.stderr.splitlines() if line.startswith(prefix)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[tuple[int, float]]:
    metrics = tmp_path_factory.mktemp("uninterrupted") / "full.jsonl"
    ok(launch(2, *COMMON, "--metrics-file", str(metrics)))
    return losses(metrics)


def test_sigkill_mid_step_and_during_a_checkpoint_write_resume_bitwise(tmp_path, uninterrupted):
    """Killed mid-step, while a checkpoint is written and right after one is complete (the logger: the step's
    metrics record is written before its checkpoint, so the resume from it keeps it), the run resumes bitwise."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    proc = launch(2, *COMMON, "--metrics-file", str(metrics), "--checkpoint-dir", str(ckpt), "--checkpoint-every",
                  "1", faults="kill@1:rank=1,kill@2:rank=0:at=checkpoint:launch=1,kill@3:rank=0:at=saved:launch=2",
                  restarts=3)
    ok(proc)
    assert losses(metrics) == uninterrupted
    summary = records(metrics)[-1]
    assert summary["restarts"] == 3 and summary["restart_s"] > 0
    refused = [line for line in proc.stderr.splitlines() if line.startswith("warning: checkpoint")]
    assert any(".tmp-step-00000003" in line and "partial" in line and "step-00000002" in line
               for line in refused), proc.stderr[-3000:]
    assert not has_traceback(proc.stderr)
    # a corrupted newest checkpoint is refused in one line naming it; the previous one is used, bitwise
    shard = sorted((ckpt / "step-00000005").glob("*.distcp"))[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    resumed = launch(2, *COMMON, "--metrics-file", str(metrics), "--checkpoint-dir", str(ckpt), "--resume")
    ok(resumed)
    refused = [line for line in resumed.stderr.splitlines() if line.startswith("warning: checkpoint")
               and "step-00000005" in line]
    assert len(refused) == 1 and "sha256 mismatch" in refused[0] and refused[0].endswith("step-00000004"), \
        resumed.stderr[-3000:]
    assert losses(metrics) == uninterrupted  # step 4 re-run from step 4's checkpoint


def test_sigstop_is_detected_within_the_collective_timeout_restarted_and_resumed(tmp_path, uninterrupted):
    """A rank stopped mid-run, and (the restart) one stopped after the last step's checkpoint while the others wait
    in the final barrier: each ends its launch in lines naming the step, where and the stopped rank, leaves its
    fault for the next launch's count, and the run resumes bitwise."""
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    proc = launch(2, *COMMON, "--metrics-file", str(metrics), "--checkpoint-dir", str(ckpt), "--checkpoint-every",
                  "1", "--collective-timeout", "4",
                  faults="stop@2:rank=1:for=12,stop@4:rank=1:at=saved:for=12:launch=1", restarts=2)
    ok(proc)
    assert losses(metrics) == uninterrupted
    stalled = [line for line in errors(proc) if "made no progress" in line or "a collective failed" in line]
    first = [line for line in stalled if "step 2" in line]
    assert first and all("exit code 76" in line for line in stalled), proc.stderr[-3000:]
    assert any("rank 1 stopped answering" in line for line in first), proc.stderr[-3000:]  # the stopped rank
    final = [line for line in stalled if "in the final barrier" in line]
    assert final and all("step 4" in line and "rank 1 stopped answering" in line for line in final), \
        proc.stderr[-3000:]
    assert "stacks of every thread" in proc.stderr or "a collective failed" in proc.stderr
    assert not has_traceback(proc.stderr)
    summary = records(metrics)[-1]
    assert summary["restarts"] == 2 and summary["stalls"] == 2 and summary["restart_s"] > 0


def test_a_diverged_collective_order_is_one_line(tmp_path):
    proc = launch(2, "--pp", "1", "--dp", "2", "--ep", "2", "--steps", "3", faults="diverge@1:rank=1")
    assert proc.returncode != 0
    lines = errors(proc)
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0] == ("error: collective order diverged at step 1 in group [0, 1]: collective #3 is "
                        "all_reduce(float32[1] SUM) on rank 0 but all_reduce(float32[1] MAX) on rank 1; exit code 78")


def test_nonfinite_stop_keeps_the_last_good_checkpoint_which_only_resume_continues(tmp_path):
    """A stop names the step and keeps the last good checkpoint; a new run in that directory without --resume is
    refused (its torchrun restart too: it must not pick up the other run's checkpoints); a --resume launch clears
    the stop, recovers from a kill, ends bitwise as an uninterrupted run and counts what the checkpoint it resumed
    from counted (a checkpoint write that failed before the stop)."""
    metrics, ckpt, full = tmp_path / "m.jsonl", tmp_path / "ckpt", tmp_path / "full.jsonl"
    args = ("--steps", "4", "--metrics-file", str(metrics), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1")
    proc = alone(*args, faults="enospc@0,nan@2")
    assert proc.returncode == 65, proc.stderr[-3000:]
    lines = errors(proc)
    assert len(lines) == 1 and "non-finite loss or gradient at step 2 on rank 0" in lines[0], proc.stderr
    assert f"the last complete checkpoint is {ckpt / 'step-00000002'}" in lines[0]
    assert not has_traceback(proc.stderr)
    assert [s for s, _ in losses(metrics)] == [0, 1]
    steps = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-"))
    assert steps == ["step-00000002"]

    single = ("--pp", "1", "--dp", "1", "--ep", "1")
    fresh = launch(1, *single, *args, restarts=1)
    assert fresh.returncode != 0
    refused = [line for line in errors(fresh) if "holds the checkpoints of an earlier run (step-00000002)" in line]
    assert len(refused) == 2 and all("--resume" in line for line in refused), fresh.stderr[-3000:]
    assert sorted(p.name for p in ckpt.iterdir() if p.name.startswith("step-")) == steps
    assert not has_traceback(fresh.stderr)

    resumed = launch(1, *single, *args, "--resume", faults="kill@3:rank=0", restarts=1)
    ok(resumed)
    ok(alone("--steps", "4", "--metrics-file", str(full)))
    assert losses(metrics) == losses(full)
    summary = records(metrics)[-1]
    assert summary["restarts"] == 1 and summary["checkpoint_failures"] == 1 and summary["skipped_steps"] == 0


def test_nonfinite_skip_drops_the_update_on_every_rank_alike(tmp_path):
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    proc = launch(2, "--pp", "1", "--dp", "2", "--ep", "2", "--steps", "4", "--on-nonfinite", "skip",
                  "--metrics-file", str(metrics), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "1",
                  faults="nan@1:rank=1")
    ok(proc)
    rows = records(metrics)
    assert "skipped" in rows[1] and "rank 1" in rows[1]["skipped"]
    assert all(r["loss"] is not None for r in rows[2:-1])
    summary = rows[-1]
    # every checkpoint verified that the two data-parallel replicas hold the same weights
    assert summary["skipped_steps"] == 1 and summary["checkpoint_failures"] == 0


def test_checkpoint_write_failures_are_one_warning_and_the_previous_checkpoint_is_intact(tmp_path):
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    proc = alone("--steps", "4", "--metrics-file", str(metrics), "--checkpoint-dir", str(ckpt),
                 "--checkpoint-every", "1", faults="enospc@1,eacces@2")
    ok(proc)
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning: checkpoint")]
    assert len(warnings) == 2, proc.stderr
    assert f"{ckpt / 'step-00000002'} not written: No space left on device (ENOSPC)" in warnings[0]
    assert f"{ckpt / 'step-00000003'} not written: Permission denied (EACCES)" in warnings[1]
    assert all("training continues" in line for line in warnings)
    assert sorted(p.name for p in ckpt.iterdir()) == [".bagualu2.lock", "run_state.json", "step-00000001",
                                                      "step-00000004"]
    assert records(metrics)[-1]["checkpoint_failures"] == 2


def test_a_defect_in_a_step_is_its_traceback_and_exit_code_1_not_an_abort():
    """An exception that is no user error and no failed collective (``raise``: from a forward of a fused point)."""
    proc = launch(2, *COMMON, faults="raise@1:rank=0")
    assert proc.returncode != 0
    assert "RuntimeError: BAGUALU2_FAULTS: raise@1 at forward on rank 0" in proc.stderr, proc.stderr[-4000:]
    assert "exitcode  : 1 " in proc.stderr and "terminate called" not in proc.stderr, proc.stderr[-4000:]
    assert "SIGABRT" not in proc.stderr


def test_a_small_chaos_subset_finishes_and_prints_its_table():
    proc = subprocess.run([sys.executable, "-m", "reference_trainer.experiments.chaos", "--policies", "static-under", "--seeds",
                           "3", "--layouts", "pp1-dp2-ep2", "--spike-rates", "0.3", "--steps", "3", "--bound-s",
                           "240", "--collective-timeout", "30", "--json"], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["policy"], r["layout"], r["outcome"]) for r in rows] == [("static-under", "pp1-dp2-ep2", "finished")]
    assert "chaos runs" in proc.stdout
