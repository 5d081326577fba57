"""The trainer's resilience pieces in one process: fault specs, the collective-order checker's signatures and its
one-line report, the watchdog (in a child process: it exits), the new flags' validation, checkpoint write causes."""

from __future__ import annotations

import errno
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from reference_trainer import collectives, faults, train
from reference_trainer.checkpoint import CheckpointError, save
from reference_trainer.resilience import all_finite, sums_finite
from reference_trainer.watchdog import STALL_EXIT_CODE, Watchdog, collective_failure, termination_signal


def test_fault_specs_parse_and_bad_ones_are_one_line():
    parsed = faults.parse("kill@3:rank=1, stop@2:rank=0:at=checkpoint:launch=1,nan@5")
    assert parsed == (faults.Fault(kind="kill", step=3, rank=1), faults.Fault(kind="stop", step=2, at="checkpoint",
                                                                                launch=1),
                      faults.Fault(kind="nan", step=5))
    assert faults.parse("") == ()
    assert faults.parse("stop@2:rank=1:for=12") == (faults.Fault(kind="stop", step=2, rank=1, for_s=12),)
    for bad, fragment in [("boom@1", "kind must be one of"), ("kill", "must look like KIND@STEP"),
                          ("kill@x", "must look like"), ("kill@1:rank=-1", "rank must be an integer"),
                          ("kill@1:at=lunch", "at must be one of"), ("kill@1:who=2", "unknown option"),
                          ("kill@1:for=3", "for= applies to stop only"), ("stop@1:for=x", "for must be")]:
        with pytest.raises(ValueError, match=fragment) as info:
            faults.parse(bad)
        assert str(info.value).startswith("BAGUALU2_FAULTS: ") and "\n" not in str(info.value)


def test_faults_fire_only_on_their_rank_step_and_launch():
    spec = faults.parse("nan@2:rank=1,enospc@3,eacces@4:launch=1")
    mine = faults.Faults(spec, rank=1, launch=0)
    params = [("w", torch.nn.Parameter(torch.ones(2)))]
    params[0][1].grad = torch.ones(2)
    assert not mine.poison(1, params) and torch.isfinite(params[0][1].grad).all()
    assert mine.poison(2, params) and torch.isnan(params[0][1].grad).all()
    assert mine.write_error(3) is None  # rank 0's
    rank0 = faults.Faults(spec, rank=0, launch=0)
    assert rank0.write_error(3).errno == errno.ENOSPC and rank0.write_error(4) is None
    assert faults.Faults(spec, rank=0, launch=1).write_error(4).errno == errno.EACCES


def test_signatures_keep_what_members_agree_on():
    x = torch.zeros(5, 3)
    assert collectives._signature("all_reduce", (x,), {"op": torch.distributed.ReduceOp.MAX}) == \
        "all_reduce(float32[5, 3] MAX)"
    # an uneven all-to-all: dim 0 differs between members, the rest must not
    assert collectives._signature("all_to_all_single", (torch.zeros(7, 3), x), {}) == \
        "all_to_all_single(float32[3])"
    assert collectives._signature("all_gather_object", ([None], {"a": 1}), {}) == "all_gather_object"


def test_first_difference_names_the_step_group_and_collective():
    key = ((0, 1), "2")
    sequences = [{key: ["all_gather(int64[8])", "all_to_all_single(float32[64])"]},
                 {key: ["all_gather(int64[8])", "all_reduce(float64[2] MAX)"]}]
    assert collectives.first_difference(4, key, sequences) == (
        "collective order diverged at step 4 in group [0, 1]: collective #2 is all_to_all_single(float32[64]) on "
        "rank 0 but all_reduce(float64[2] MAX) on rank 1")
    shorter = [{key: ["barrier"]}, {key: ["barrier", "barrier"]}]
    assert "collective #2 is nothing on rank 0 but barrier on rank 1" in collectives.first_difference(0, key, shorter)


@pytest.mark.launch
def test_the_watchdog_dumps_stacks_and_exits_with_one_line():
    code = textwrap.dedent("""
        import time
        from reference_trainer.watchdog import Watchdog
        dog = Watchdog(timeout_s=0.5, rank=3, describe=lambda: "last collective #2 barrier on group [0, 3]").start()
        dog.beat("the forward of c0.m1", step=7)
        time.sleep(30)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == STALL_EXIT_CODE
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1
    expected = (r"error: rank 3 made no progress for (0\.[5-9]|[1-9]\.\d) s \(--collective-timeout 0\.5\) at step 7 in "
                r"the forward of c0\.m1; last collective #2 barrier on group \[0, 3\]; stacks above")
    assert re.match(expected, lines[0]), lines[0]
    assert "Thread" in proc.stderr and "time.sleep" not in lines[0]  # faulthandler's dump precedes the line


def test_heartbeats_name_the_ranks_that_stopped_answering(monkeypatch):
    """Three ranks' heartbeats in one real TCP store: rank 2 stops publishing; the live ranks' lines name it, its
    step and what it was doing, and never themselves or a rank that has not started yet."""
    import datetime
    import time

    from reference_trainer.watchdog import Heartbeats

    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=5),
                                       wait_for_workers=False)
    beats = [Heartbeats(store, rank=rank, world_size=4, stale_s=3.0) for rank in range(4)]
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now)
    beats[2].publish(3, "the forward of c0.m1")
    now += 11
    beats[0].publish(4, "the gradient reduction")
    beats[1].publish(4, "the gradient reduction")
    assert beats[0].silent() == "rank 2 stopped answering 11 s ago (last heard at step 3, in the forward of c0.m1)"
    assert beats[1].silent() == beats[0].silent()  # rank 3 never published: not named by a rank not publishing
    assert beats[2].silent() == ""  # what rank 2 would say of the others: they answer


def test_heartbeats_start_with_the_set_up_and_name_a_rank_never_heard_from(monkeypatch):
    """A rank publishes from its set-up on (step -1: no step yet); once this rank has published for longer than
    ``stale_s``, a rank that never published is named too (it stopped before or during its set-up)."""
    import datetime
    import time

    from reference_trainer.watchdog import Heartbeats

    store = torch.distributed.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=datetime.timedelta(seconds=5),
                                       wait_for_workers=False)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now)
    beats = [Heartbeats(store, rank=rank, world_size=3, stale_s=3.0, period_s=60.0) for rank in range(3)]
    beats[0].start(lambda: (-1, "the set-up"))
    beats[1].start(lambda: (-1, "the resume load"))
    beats[1].start(lambda: (5, "twice"))  # a second start does nothing
    time.sleep(0.5)  # the threads' first beats
    assert beats[0].silent() == ""  # rank 2 has had no time to start yet
    now += 10
    beats[0].publish(-1, "the set-up")
    assert beats[0].silent() == ("rank 1 stopped answering 10 s ago (last heard in the resume load); rank 2 was "
                                 "never heard from (it stopped before its set-up, or during it)")
    for beat in beats:
        beat.stop()


def test_the_watchdog_stays_quiet_while_beats_come_and_refuses_a_bad_timeout():
    dog = Watchdog(timeout_s=0.3, rank=0, on_stall=lambda *_: pytest.fail("stalled"))
    dog._stalled = lambda idle: pytest.fail("stalled")  # must not be reached
    dog.start()
    import time

    for _ in range(10):
        dog.beat("busy")
        time.sleep(0.05)
    dog.stop()
    with pytest.raises(ValueError, match="--collective-timeout must be > 0"):
        Watchdog(timeout_s=0, rank=0)


def test_collective_failures_are_recognised_in_a_chain():
    inner = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1")
    try:
        try:
            raise inner
        except RuntimeError as exc:
            raise ValueError("stage 1 failed") from exc
    except ValueError as outer:
        assert collective_failure(outer) is inner
    assert collective_failure(ValueError("a bug")) is None


def test_a_launcher_signal_is_found_behind_the_pipeline_error_it_caused():
    from torch.distributed.elastic.multiprocessing.api import SignalException

    try:
        try:
            raise SignalException("Process 1 got signal: 15", sigval=signal.SIGTERM)
        except SignalException as exc:
            raise RuntimeError("[Stage 1] failed to run forward") from exc
    except RuntimeError as outer:
        assert termination_signal(outer) == signal.SIGTERM
    assert termination_signal(RuntimeError("Timed out waiting 4000ms for recv")) is None


@pytest.mark.parametrize("args, fragment", [
    (["--collective-timeout", "0"], "--collective-timeout must be a finite number"),
    (["--collective-timeout", "0.001"], "--collective-timeout must be a finite number in [0.1, 1e+07], got 0.001"),
    (["--collective-timeout", "nan"], "--collective-timeout must be a finite number"),
    (["--on-nonfinite", "ignore"], "--on-nonfinite"),
])
def test_new_flags_are_validated_in_one_line(args, fragment, capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as info:
        train.main(["--pp", "1", "--dp", "1", "--ep", "1", *args])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and len(err) == 1 and fragment in err[0], err


def test_a_bad_fault_spec_is_a_user_error(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("BAGUALU2_FAULTS", "kill@soon")
    with pytest.raises(SystemExit) as info:
        train.main(["--pp", "1", "--dp", "1", "--ep", "1", "--steps", "1"])
    assert info.value.code == 2 and "BAGUALU2_FAULTS" in capsys.readouterr().err


def test_a_failed_checkpoint_write_names_the_cause_and_leaves_nothing(tmp_path):
    state = {"w": torch.arange(4.0)}
    save(tmp_path, 1, state)
    with pytest.raises(CheckpointError) as info:
        save(tmp_path, 2, state, write_error=OSError(errno.ENOSPC, "No space left on device"))
    message = str(info.value)
    assert message.startswith(f"checkpoint {tmp_path / 'step-00000002'} not written: No space left on device "
                              "(ENOSPC)") and "\n" not in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000001"]  # no .tmp-* left, step 1 intact
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="cannot be written: Not a directory"):
        save(blocker / "ckpt", 1, state)


ENTRIES = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True), st.sampled_from([3.4e38, -3.4e38]))


@settings(deadline=None)
@given(st.lists(st.lists(ENTRIES, min_size=1, max_size=6), max_size=4))
def test_all_finite_is_an_entry_by_entry_check(tensors):
    """A finite sum proves finiteness; huge finite entries whose sum overflows are still finite; NaN and inf are
    found wherever they are."""
    ts = [torch.tensor(t, dtype=torch.float32) for t in tensors]
    assert bool(all_finite(ts)) == all(bool(torch.isfinite(t).all()) for t in ts)
    for t, ok in zip(ts, sums_finite(ts).tolist()):  # the one-pass verdict never calls a non-finite tensor finite
        assert not ok or bool(torch.isfinite(t).all())
