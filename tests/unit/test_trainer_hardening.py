"""Inputs of the reference trainer that must end in one line, never block, and never lose a valid checkpoint: a
pipe or device as data or as a checkpoint's manifest, an unusable run-state directory, a corrupt newer checkpoint
beside valid ones, markers left by an earlier launch, ``--steps`` below the resumed checkpoint; the restart history
kept where an out-of-memory restart finds it, and carried across launches as documented."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import pytest
import torch

from reference_trainer import checkpoint
from reference_trainer.checkpoint import find_latest, save
from reference_trainer.data import TokenCorpus, load_tokenizer
from reference_trainer.loop import check_state_dir
from reference_trainer.recipes import recipe
from reference_trainer.restarts import LOCK, STATE, RunState, read_refusal, state_directory, write_refusal


def test_a_pipe_or_a_device_as_data_is_refused_without_reading_it(tmp_path):
    fifo = tmp_path / "fifo.txt"
    os.mkfifo(fifo)  # reading it would block forever
    device = tmp_path / "zero.txt"
    device.symlink_to("/dev/zero")  # reading it would never end
    for path in (fifo, device):
        with pytest.raises(ValueError, match="not a regular file") as info:
            TokenCorpus.from_path(str(path), load_tokenizer())
        assert "\n" not in str(info.value) and str(path) in str(info.value)
    folder = tmp_path / "corpus"  # the same inside a directory, and a dangling link: never skipped in silence
    folder.mkdir()
    (folder / "a.txt").write_text("some text\n")
    for name, target in (("b.txt", tmp_path / "missing.txt"), ("z.jsonl", "/dev/zero")):
        (folder / name).symlink_to(target)
        with pytest.raises(ValueError, match=f"{name}: not a regular file"):
            TokenCorpus.from_path(str(folder), load_tokenizer())
        (folder / name).unlink()


@pytest.mark.slow
def test_a_pipe_as_manifest_is_refused_and_the_older_checkpoint_used(tmp_path, capsys):
    old = save(tmp_path, 1, {"w": torch.arange(3.0)})
    bad = tmp_path / "step-00000002"
    bad.mkdir()
    os.mkfifo(bad / checkpoint.MANIFEST)
    assert find_latest(tmp_path) == (old, 1)
    assert "manifest.json is not a regular file" in capsys.readouterr().err


def test_a_corrupt_newer_checkpoint_never_pushes_a_valid_one_out(tmp_path):
    save(tmp_path, 4, {"w": torch.arange(3.0)})
    corrupt = tmp_path / "step-00000008"
    corrupt.mkdir()
    (corrupt / checkpoint.MANIFEST).write_text("{bad")
    save(tmp_path, 5, {"w": torch.arange(4.0)})  # keep=2: step 4 and step 5 are the two complete ones
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004", "step-00000005", "step-00000008"]


def _config(**changes):
    return recipe("glm_moe_debug").with_overrides(pp=1, dp=1, ep=1, **changes)


@pytest.mark.parametrize("case", ["parent_is_a_file", "state_is_a_dir", "metrics_dir_unwritable"])
def test_an_unusable_run_state_directory_is_one_line(tmp_path, case):
    if case == "parent_is_a_file":
        (tmp_path / "afile").write_text("x")
        config, fragment = _config(checkpoint_dir=str(tmp_path / "afile" / "ck")), "--checkpoint-dir: cannot write"
    elif case == "state_is_a_dir":
        (tmp_path / "ck" / STATE).mkdir(parents=True)
        config, fragment = _config(checkpoint_dir=str(tmp_path / "ck")), "is not a regular file"
    else:
        if os.geteuid() == 0:  # root writes anywhere; /proc takes no new files even for root
            config = _config(metrics_file="/proc/bagualu2-metrics.jsonl")
        else:
            locked = tmp_path / "locked"
            locked.mkdir(mode=0o500)
            config = _config(metrics_file=str(locked / "m.jsonl"))
        fragment = "--metrics-file: cannot write"
    with pytest.raises(ValueError, match=fragment) as info:
        check_state_dir(config)
    assert "\n" not in str(info.value)


def test_markers_of_an_earlier_launch_are_removed_on_a_resumed_launch(tmp_path):
    (tmp_path / "fault-rank0.json").write_text(json.dumps({"time": 1.0, "step": 3, "rank": 0, "kind": "stall",
                                                           "message": "old"}))
    (tmp_path / STATE).write_text(json.dumps({"restarts": 2, "stalls": 1}))
    resumed = RunState(str(tmp_path), fresh=False, first_launch=True)
    assert resumed.data["stalls"] == 1 and not list(tmp_path.glob("fault-rank*.json"))  # history kept, marker gone
    (tmp_path / "fault-rank1.json").write_text(json.dumps({"time": 2.0, "step": 4, "rank": 1, "kind": "stall",
                                                           "message": "this launch"}))
    RunState(str(tmp_path), fresh=False, first_launch=False)  # a torchrun restart reads this launch's markers
    assert list(tmp_path.glob("fault-rank*.json"))


def test_the_restart_history_lives_where_a_restart_finds_it(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    assert state_directory(str(tmp_path / "ck"), str(tmp_path / "m" / "x.jsonl")) == str(tmp_path / "ck")
    assert state_directory(None, str(tmp_path / "m" / "x.jsonl")) == str(tmp_path / "m")
    assert state_directory(None, None) is None  # one process: nothing restarts it
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id is no run's own
    assert state_directory(None, None) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "3f2a/../x y")  # --standalone draws a uuid; any id stays one name
    folder = state_directory(None, None)
    assert folder == str(tmp_path / "tmp" / "bagualu2-run-3f2a_.._x_y") and os.path.isdir(folder)
    (tmp_path / "tmp" / "bagualu2-run-3f2a_.._x_y").rmdir()
    (tmp_path / "tmp" / "bagualu2-run-3f2a_.._x_y").write_text("")  # a file of that name: nothing is kept
    assert state_directory(None, None) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "other")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # two nodes: rank 0 could not read the other node's markers
    assert state_directory(None, None) is None


def test_a_resumed_launch_clears_a_stop_and_a_fallback_stays_in_force(tmp_path):
    (tmp_path / STATE).write_text(json.dumps({"policies": ["static-under", "static-over"]}))  # an earlier run's
    RunState(str(tmp_path), fresh=True, first_launch=True).launched("flexible", fresh=True, is_logger=True)
    assert RunState(str(tmp_path), fresh=False).policy_in_force() == "flexible"  # a restart reads this run's
    first = RunState(str(tmp_path), fresh=True, first_launch=True)
    first.launched("static-under", fresh=True, is_logger=True)
    first.record_stop(step=2, message="nan", is_logger=True)
    restart = RunState(str(tmp_path), fresh=False)  # torchrun's restart of that launch: still stopped
    assert restart.data["stopped"] == {"step": 2, "message": "nan"}
    resumed = RunState(str(tmp_path), fresh=False, first_launch=True)  # a --resume launch
    assert resumed.data["stopped"] is None
    resumed.launched("static-under", fresh=False, is_logger=True)
    resumed.restarted(restart_count=1, resume_step=2, policy="static-over", is_logger=True)
    again = RunState(str(tmp_path), fresh=False)
    assert again.policy_in_force() == "static-over" and again.data["stopped"] is None
    assert again.data["policies"] == ["static-under", "static-over"]


def test_a_refused_launch_is_refused_by_its_restarts_only(tmp_path, monkeypatch):
    """The refusal carries torchrun's run id: a restart of that launch reads it, another job's never does, and a
    new launch into the directory removes it."""
    message = "--checkpoint-dir x holds the checkpoints of an earlier run"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    write_refusal(str(tmp_path), message)
    assert read_refusal(str(tmp_path)) == message
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")  # a run still going in that directory
    assert read_refusal(str(tmp_path)) is None
    RunState(str(tmp_path), fresh=True, first_launch=True)  # a new launch starts over
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    assert read_refusal(str(tmp_path)) is None and read_refusal(None) is None


@pytest.mark.launch
def test_steps_below_the_resumed_checkpoint_and_an_edited_manifest_are_one_line(tmp_path):
    base = [sys.executable, "-m", "reference_trainer.train", "--pp", "1", "--dp", "1", "--ep", "1",
            "--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    first = subprocess.run(base + ["--steps", "2"], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    history = (tmp_path / "ck" / STATE).read_text()
    again = subprocess.run(base + ["--steps", "1", "--resume", "--policy", "ideal"], capture_output=True, text=True,
                           env=env, timeout=300)
    lines = [line for line in again.stderr.splitlines() if line.strip()]
    assert again.returncode == 2 and lines == [lines[0]] and "--steps 1 is below step 2" in lines[0], again.stderr
    assert (tmp_path / "ck" / STATE).read_text() == history  # a refused launch leaves the run's history as it was
    # what the numbers depend on must be the checkpoint's: a changed value is refused, naming the flag
    for changed, fragment in ((["--lr", "0.001"], "was trained with --lr 0.003; this run has --lr 0.001"),
                              (["--spike-max", "1.5"], "--spike-max 2.0; this run has --spike-max 1.5"),
                              (["--recipe", "glm_moe_bench", "--spike-rate", "0"],
                               "was trained with another --recipe (")):
        refused = subprocess.run(base + ["--steps", "4", "--resume", *changed], capture_output=True, text=True,
                                 env=env, timeout=300)
        lines = [line for line in refused.stderr.splitlines() if line.strip()]
        assert refused.returncode == 2 and lines == [lines[0]] and fragment in lines[0], refused.stderr
        assert lines[0].startswith("error: --resume: checkpoint "), lines
    # a manifest edited to another step (its directory renamed to match) disagrees with what the ranks saved
    moved = tmp_path / "ck" / "step-00000005"
    (tmp_path / "ck" / "step-00000002").rename(moved)
    manifest = json.loads((moved / checkpoint.MANIFEST).read_text())
    (moved / checkpoint.MANIFEST).write_text(json.dumps({**manifest, "step": 5}))
    edited = subprocess.run(base + ["--steps", "6", "--resume"], capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in edited.stderr.splitlines() if line.strip()]
    assert edited.returncode == 2 and lines == [lines[0]], edited.stderr
    assert "manifest records step 5, its ranks saved step 2" in lines[0], edited.stderr


def test_a_full_disk_stops_the_metrics_log_with_one_warning_not_the_run(tmp_path, capsys):
    from reference_trainer.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path / "m.jsonl", rank=0)
    writer.write({"step": 0})
    writer._file.close()
    writer._file = open("/dev/full", "wb", buffering=0)  # every write: ENOSPC, as on a full disk
    writer.write({"step": 1})
    writer.write({"step": 2})  # no longer written, no second warning
    writer.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "no more records are written, training continues" in warnings[0]
    assert (tmp_path / "m.jsonl").read_text() == '{"step": 0}\n'


def test_a_disk_that_fills_within_a_record_leaves_the_last_whole_record(tmp_path, capsys):
    """The disk takes part of a record, then refuses the rest: the file ends with the last whole record."""
    import errno

    from reference_trainer.metrics import MetricsWriter

    class FillsUp:
        def __init__(self, raw):
            self.raw, self.calls = raw, 0

        def write(self, data):
            self.calls += 1
            if self.calls == 1:
                return self.raw.write(data[: len(data) // 2])  # a short write: half the record went out
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.raw, name)

    path = tmp_path / "m.jsonl"
    writer = MetricsWriter(path, rank=0)
    writer.write({"step": 0, "loss": 1.5})
    writer._file = FillsUp(writer._file)
    writer.write({"step": 1, "loss": 1.25, "note": "x" * 100})
    writer.close()
    assert path.read_text() == '{"step": 0, "loss": 1.5}\n'
    assert "No space left on device; no more records are written" in capsys.readouterr().err


def test_a_full_disk_under_the_run_state_is_one_warning_per_record_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    import errno

    first = RunState(str(tmp_path), fresh=True, first_launch=True)
    first.launched("flexible", fresh=True, is_logger=True)
    history = (tmp_path / STATE).read_text()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    first.record_fault(rank=1, step=3, kind="collective", message="error: ...")
    first.record_oom(rank=0, step=3, policy="flexible", message="out of memory")
    first.step_done(is_logger=True)
    first.record_stop(step=3, message="non-finite loss", is_logger=True)
    RunState(str(tmp_path), fresh=False).restarted(restart_count=1, resume_step=2, policy="flexible", is_logger=True)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line]
    assert warnings and all(line.startswith("warning: cannot write ") and "No space left on device" in line
                            for line in warnings)
    assert sorted(p.name for p in tmp_path.iterdir()) == [STATE] and (tmp_path / STATE).read_text() == history


def test_a_fault_after_the_steps_update_loses_that_step_too(tmp_path):
    for done, lost in ((3, 1), (None, 0)):  # in the step's checkpoint write; mid-step
        state = RunState(str(tmp_path), fresh=True, first_launch=True)
        state.launched("flexible", fresh=True, is_logger=True)
        state.record_fault(rank=1, step=2, kind="collective", message="error: ...", done=done)
        restart = RunState(str(tmp_path), fresh=False)
        restart.restarted(restart_count=1, resume_step=2, policy="flexible", is_logger=True)
        assert restart.data["steps_lost"] == lost and restart.data["stalls"] == 1


@pytest.mark.parametrize("text", ["null", "[1, 2]", "7", '"x"'])
def test_a_run_state_that_is_not_an_object_is_no_state(tmp_path, text):
    from reference_trainer.restarts import STATE, RunState

    (tmp_path / STATE).write_text(text)
    (tmp_path / "oom-rank0.json").write_text(text)
    state = RunState(str(tmp_path), fresh=False)
    assert state.data["restarts"] == 0 and state.markers() == [] and state.last_oom() is None


def test_restarts_count_over_every_launch_of_the_run(tmp_path):
    """A run restarted once by torchrun, killed, and resumed by a new launch that is restarted once more: two
    restarts, like its OOM events and restart seconds (the summary's ``restarts``), not the last launch's one."""
    from reference_trainer.restarts import RunState

    first = RunState(str(tmp_path), fresh=True, first_launch=True)
    first.launched("static-under", fresh=True, is_logger=True)
    RunState(str(tmp_path), fresh=False).restarted(restart_count=1, resume_step=0, policy="static-under",
                                                   is_logger=True)
    resumed = RunState(str(tmp_path), fresh=False, first_launch=True)  # --resume: a new launch, torchrun count 0
    resumed.launched("static-under", fresh=False, is_logger=True)
    assert resumed.data["restarts"] == 1
    again = RunState(str(tmp_path), fresh=False)
    again.restarted(restart_count=1, resume_step=0, policy="static-under", is_logger=True)
    assert again.data["restarts"] == 2
    again.restarted(restart_count=1, resume_step=0, policy="static-under", is_logger=False)  # another rank: the same
    assert RunState(str(tmp_path), fresh=False).data["restarts"] == 2
    assert RunState(str(tmp_path), fresh=True).data["restarts"] == 0  # a new run starts over



@pytest.mark.parametrize("timeout_s", [0.1, 1.0, 4.0, 10.0, 120.0, 600.0])
@pytest.mark.parametrize("restart", [False, True])
def test_rank_0_gives_up_the_lock_within_the_others_collective_timeout(timeout_s, restart):
    """The other ranks wait for rank 0's answer in a broadcast bounded by ``--collective-timeout``: rank 0 tries a
    held lock for less than that, so a busy directory is refused in one line (exit 2), not reported as a timed
    out collective (exit 76, restarted); before, a first launch tried it for 5 s whatever the timeout."""
    from reference_trainer.restarts import lock_wait_s

    wait_s = lock_wait_s(timeout_s, restart=restart)
    assert 0 < wait_s < timeout_s
    assert wait_s == min(60.0 if restart else 5.0, timeout_s / 2)


def test_run_state_files_nested_deeper_than_json_parses_are_no_state(tmp_path):
    """A torn or foreign state file, marker or refusal is no record (RecursionError escaped these reads before)."""
    deep = "[" * 100_000
    (tmp_path / STATE).write_text(deep)
    (tmp_path / "oom-rank0.json").write_text(deep)
    state = RunState(str(tmp_path), fresh=False)
    assert state.data["restarts"] == 0 and state.markers() == []
    (tmp_path / "refused.json").write_text(deep)
    assert read_refusal(str(tmp_path)) is None

def test_a_checkpoint_directory_is_locked_by_one_process_at_a_time(tmp_path, monkeypatch):
    """Two launches in one checkpoint directory would resume from and delete each other's checkpoints: the second
    finds the lock held (a lock is per open file, so a second open in this process meets it as another launch's
    would) and says by whom; closing the first (its process ending) frees it."""
    from reference_trainer.restarts import LOCK, lock_directory

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)  # a launch without torchrun
    first, why = lock_directory(str(tmp_path / "ckpt"))
    assert first is not None and why is None
    second, why = lock_directory(str(tmp_path / "ckpt"))
    assert second is None and why.startswith(f"it is in use by a launch that is still running (pid {os.getpid()} ")
    assert why.endswith(f", not under torchrun (parent {os.getppid()}))")  # it names no torchrun agent
    first.close()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run7")  # a torchrun worker: its parent is its agent
    first, _ = lock_directory(str(tmp_path / "ckpt"))
    second, why = lock_directory(str(tmp_path / "ckpt"))
    assert second is None and why.endswith(f", torchrun agent {os.getppid()}, torchrun run id run7)")
    first.close()
    again, why = lock_directory(str(tmp_path / "ckpt"))
    assert again is not None and why is None
    again.close()
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / LOCK).mkdir()
    assert lock_directory(str(tmp_path / "odd"))[1].endswith("exists and is not a regular file")


def test_a_refusal_under_the_run_id_none_is_the_agents_own(tmp_path, monkeypatch):
    """Under torchrun's default run id ``none``, which other launches share, a refusal is tagged with the agent's
    host and pid: its own restarts read it, another launch's restart does not."""
    from reference_trainer.restarts import read_refusal, write_refusal

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setattr(os, "getppid", lambda: 4242)
    write_refusal(str(tmp_path), "refused")
    assert read_refusal(str(tmp_path)) == "refused"
    monkeypatch.setattr(os, "getppid", lambda: 4343)  # another agent
    assert read_refusal(str(tmp_path)) is None
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "abc")
    write_refusal(str(tmp_path), "refused too")
    assert read_refusal(str(tmp_path)) == "refused too"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "other")
    assert read_refusal(str(tmp_path)) is None


def test_a_restart_waits_for_its_previous_attempt_to_let_the_lock_go(tmp_path):
    import threading

    from reference_trainer.restarts import lock_directory

    held, _ = lock_directory(str(tmp_path))
    threading.Timer(0.5, held.close).start()  # the previous rank 0 exits a moment later
    again, why = lock_directory(str(tmp_path), wait_s=20.0)
    assert again is not None and why is None
    again.close()


def test_the_temp_folders_of_runs_whose_agent_exited_are_swept_and_no_other(tmp_path, monkeypatch):
    """A run with neither a checkpoint directory nor a metrics file keeps its state in a temp folder of its own;
    one that failed with no restart left (or was killed) leaves it. The next such launch removes the folders whose
    recorded agent has exited on this host, and keeps its own, live agents', other hosts', unrecorded ones and
    anything that is not a folder; nor one whose lock a live rank 0 holds."""
    from reference_trainer.restarts import lock_directory, sweep_finished_runs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with open("/proc/sys/kernel/pid_max") as limit:
        exited = int(limit.read())  # pids are below it: no process holds it
    host = os.uname().nodename
    records = {"dead": {"host": host, "pid": exited}, "live": {"host": host, "pid": os.getpid()},
               "elsewhere": {"host": host + "-other", "pid": exited}, "unrecorded": None,
               "own": {"host": host, "pid": exited}, "locked": {"host": host, "pid": exited},
               "huge": {"host": host, "pid": 2**40}}
    for name, agent in records.items():
        folder = tmp_path / f"bagualu2-run-{name}"
        folder.mkdir()
        (folder / "oom-rank1.json").write_text("{}")
        (folder / STATE).write_text(json.dumps({"restarts": 0} if agent is None else {"agent": agent}))
    (tmp_path / "bagualu2-run-file").write_text("{}")
    held, _ = lock_directory(str(tmp_path / "bagualu2-run-locked"))  # a live rank 0 that has not recorded its agent
    (tmp_path / "bagualu2-run-torn").mkdir()
    (tmp_path / "bagualu2-run-torn" / STATE).write_text('{"agent": {"ho')
    assert sweep_finished_runs(tmp_path / "bagualu2-run-own") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bagualu2-run-elsewhere", "bagualu2-run-file", "bagualu2-run-huge", "bagualu2-run-live",
        "bagualu2-run-locked", "bagualu2-run-own", "bagualu2-run-torn", "bagualu2-run-unrecorded"]
    held.close()  # that rank 0 exited: its folder goes at the next sweep
    assert sweep_finished_runs(tmp_path / "bagualu2-run-own") == 1
    assert not (tmp_path / "bagualu2-run-locked").exists()
    state = RunState(str(tmp_path / "bagualu2-run-new"), fresh=True, first_launch=True)
    state.launched("flexible", fresh=True, is_logger=True)  # a launch records its agent: the worker's parent
    saved = json.loads((tmp_path / "bagualu2-run-new" / STATE).read_text())
    assert saved["agent"] == {"host": host, "pid": os.getppid()}


def test_the_temp_folder_of_a_launch_that_failed_in_its_set_up_is_swept_by_its_lock(tmp_path, monkeypatch):
    """A launch that fails before its logger writes ``run_state.json`` left only its lock file and fault markers:
    the lock names the agent, so the folder goes once that agent has exited (and stays while it runs)."""
    from reference_trainer.restarts import lock_directory, sweep_finished_runs

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")  # a worker of torchrun's (temp folders are only theirs)
    with open("/proc/sys/kernel/pid_max") as limit:
        exited = int(limit.read())
    for name, agent in (("failed", exited), ("running", os.getpid())):
        monkeypatch.setattr(os, "getppid", lambda agent=agent: agent)
        held, why = lock_directory(str(tmp_path / f"bagualu2-run-{name}"))
        assert why is None and f", torchrun agent {agent}, " in (tmp_path / f"bagualu2-run-{name}" / LOCK).read_text()
        (tmp_path / f"bagualu2-run-{name}" / "fault-rank1.json").write_text("{}")
        held.close()  # rank 0 exited
    (tmp_path / "bagualu2-run-other").mkdir()
    (tmp_path / "bagualu2-run-other" / LOCK).write_text(f"pid 1 on {os.uname().nodename}-other, torchrun agent "
                                                        f"{exited}, torchrun run id x\n")
    assert sweep_finished_runs(tmp_path / "bagualu2-run-own") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bagualu2-run-other", "bagualu2-run-running"]


def test_a_launch_removes_the_temp_files_of_record_writes_a_killed_process_left(tmp_path):
    """A rank killed while writing a marker leaves ``_write_json``'s temp file: the next launch in the directory
    removes those older than itself, and no other file."""
    old = time.time() - 60
    for name in (".fault-rank3.json.tas5gbyf", ".run_state.json.x1", ".oom-rank0.json.y", ".keep.json.z", "notes"):
        (tmp_path / name).write_text("{")
        os.utime(tmp_path / name, (old, old))
    (tmp_path / ".oom-rank1.json.now").write_text("{")  # another rank of this launch, writing
    RunState(str(tmp_path), fresh=False, first_launch=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".keep.json.z", ".oom-rank1.json.now", "notes"]
