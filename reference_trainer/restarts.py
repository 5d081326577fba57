"""Out-of-memory -> restart bookkeeping across torchrun's worker-group restarts (the paper's §II-B cost).

A worker that runs out of activation memory writes ``oom-rank<r>.json`` (time, step, policy) into the run's state
directory (:func:`state_directory`: ``--checkpoint-dir``, else the metrics file's directory, else one named after
torchrun's run id in the temp directory) and exits with ``OOM_EXIT_CODE``; torchrun's elastic agent
(``--max-restarts``) stops the group and starts it again. Rank 0 of the restarted group reads the markers and tells
every rank the policy to run (the fallback of the one that ran out of memory; a fallback taken earlier stays in
force across later restarts), then folds the markers into
``run_state.json``: OOM events, restarts, steps lost (the failed step minus the checkpoint it resumes from), and,
once its first step completes, the restart seconds (from the error to that step); restarts count over every
launch of the run (a ``--resume`` launch goes on from the earlier launches' count). ``started_at`` is the first
launch's time, so the effective tokens/s count every restart and every lost step. Files are written atomically.

Other faults restart the same way: a rank whose watchdog saw no progress, or whose collective failed, writes
``fault-rank<r>.json`` before it exits (``STALL_EXIT_CODE``); the restart counts it in ``stalls``, its lost steps
and its restart seconds alike. A rank killed outright leaves no marker: its restart's seconds are counted from the
restarted launch's start (a lower bound) and its lost steps are unknown (not counted). A run stopped on a
non-finite loss (``--on-nonfinite stop``) is recorded as ``stopped``: torchrun's automatic restarts refuse to go
on; a new launch (``--resume``) may, and clears it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STATE = "run_state.json"
TEMP_PREFIX = "bagualu2-run-"  # the state folders of runs without a checkpoint directory or metrics file


def _write_json(path: Path, data: dict) -> bool:
    """Write ``path`` atomically (a temp file, then a rename). A write the file system refuses (a full disk, a
    folder made read-only) leaves nothing behind and prints one warning: the run goes on without that record
    (its restart then knows less: an out-of-memory restart without its marker runs the same policy again). False
    when refused."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return True
    except OSError as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        sys.stderr.write(f"warning: cannot write {path}: {exc.strerror or exc}; the run's restart history goes on "
                         "without this record\n")  # one write: ranks that share a log do not interleave it
        sys.stderr.flush()
        return False


REFUSED = "refused.json"
MARKERS = ("oom-rank*.json", "fault-rank*.json", REFUSED)  # what failing workers leave for the restart


def _run_id() -> str:
    return os.environ.get("TORCHELASTIC_RUN_ID", "")


def _refusal_tag() -> str:
    """Whose refusal a ``refused.json`` is: torchrun's run id, or under the run id ``none`` (torchrun's default
    without ``--standalone`` or ``--rdzv-id``, which other launches share) the agent's host and pid, which stay the
    same across the agent's restarts of its workers."""
    run_id = _run_id()
    if run_id not in ("", "none"):
        return run_id
    agent = _agent()
    return f"none@{agent['host']}:{agent['pid']}"


def write_refusal(directory: str | None, message: str) -> None:
    """A launch refused to start (another run's checkpoints in its directory): torchrun's restarts of it refuse
    alike, where what they find differs (a restart resumes from what is there). Tagged with :func:`_refusal_tag`, so
    that no other job's restart reads it."""
    if directory is not None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        _write_json(Path(directory) / REFUSED, {"time": time.time(), "message": message, "run_id": _refusal_tag()})


LOCK = ".bagualu2.lock"
BUSY = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)  # flock's "held by another": anything else cannot lock


def lock_wait_s(collective_timeout_s: float, *, restart: bool) -> float:
    """How long rank 0 tries the directory's lock: a restart waits for its previous attempt's rank 0 to exit (up to
    a minute), a first launch 5 s; either at most half the collective timeout, within which the other ranks, waiting
    in the broadcast of the answer, hear it instead of timing out."""
    return min(60.0 if restart else 5.0, 0.5 * collective_timeout_s)


def lock_directory(directory: str, *, wait_s: float = 0.0) -> tuple[Any, str | None]:
    """An exclusive lock on the run's state ``directory`` (its checkpoint directory, or its own temp folder, which
    keeps other launches' :func:`sweep_finished_runs` out) for this process's life (the system releases it when the
    process ends, killed included, so torchrun's restarts of the launch take it again), tried for up to ``wait_s``
    seconds (a restart's previous rank 0 may still be exiting): ``(open lock file, None)``, ``(None, why)`` when
    another live process holds it or the lock file cannot be made, and ``(None, None)`` with a warning where the
    file system has no locks (some NFS, Lustre or FUSE mounts): the run goes on unprotected."""
    import fcntl

    path = Path(directory) / LOCK
    try:
        Path(directory).mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or (path.exists() and not path.is_file()):
            return None, f"{path} exists and is not a regular file"
        handle = open(path, "a+", encoding="utf-8", errors="replace")
    except OSError as exc:
        return None, f"cannot make its lock file {path} ({exc.strerror or exc})"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as exc:
            if exc.errno not in BUSY:
                handle.close()
                sys.stderr.write(f"warning: cannot lock {path} ({exc.strerror or exc}): nothing keeps a second "
                                 "launch out of this checkpoint directory\n")
                sys.stderr.flush()
                return None, None
            if time.monotonic() >= deadline:
                handle.seek(0)
                holder = " ".join(handle.read(200).split()) or "another process"
                handle.close()
                return None, f"it is in use by a launch that is still running ({holder})"
            time.sleep(0.5)
    handle.seek(0)
    handle.truncate()
    agent = _agent()  # read by sweep_finished_runs where the run's state was never written (a failed set-up)
    if _run_id():  # torchrun always sets one ("none" by default)
        handle.write(f"pid {os.getpid()} on {agent['host']}, torchrun agent {agent['pid']}, torchrun run id "
                     f"{_run_id() or 'none'}\n")
    else:  # a launch without torchrun: its parent is whatever started it
        handle.write(f"pid {os.getpid()} on {agent['host']}, not under torchrun (parent {agent['pid']})\n")
    handle.flush()
    return handle, None


def read_refusal(directory: str | None) -> str | None:
    """The message of the refused launch this process is a torchrun restart of (same :func:`_refusal_tag`), else
    None."""
    path = Path(directory) / REFUSED if directory is not None else None
    if path is None or not path.is_file() or path.is_symlink():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(record, dict) or record.get("run_id") != _refusal_tag():
        return None
    return str(record.get("message", ""))


def state_directory(checkpoint_dir: str | None, metrics_file: str | None) -> str | None:
    """Where the run's restart history lives: ``checkpoint_dir``, else ``metrics_file``'s directory, else, under
    torchrun with a run id of its own (``--standalone`` draws one; ``--rdzv-id``) on one node, ``bagualu2-run-<id>``
    in the system's temp directory (this user's), so that an out-of-memory restart still knows what ran out (None:
    one process, a run id of ``none``, several nodes, or a temp folder that cannot be made or is not this
    user's)."""
    if checkpoint_dir:
        return checkpoint_dir
    if metrics_file:
        return os.path.dirname(os.path.abspath(metrics_file))
    run_id = _run_id()
    world = os.environ.get("WORLD_SIZE")
    if run_id in ("", "none") or world is None or os.environ.get("LOCAL_WORLD_SIZE", world) != world:
        return None  # one process, no id of its own, or several nodes (whose temp folders rank 0 cannot read)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id)[:64]
    folder = os.path.join(tempfile.gettempdir(), f"{TEMP_PREFIX}{safe}")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        info = os.lstat(folder)
    except OSError:
        return None
    owned = stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
    return folder if owned else None


def _agent() -> dict:
    """This worker's torchrun agent (its parent process) on this host."""
    return {"host": os.uname().nodename, "pid": os.getppid()}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # EPERM: a process of another user holds the pid; a pid no system has
        return True
    return True


def _recorded_agent(folder: Path) -> Any:
    """The torchrun agent a run's folder records: its ``run_state.json``'s, else (a launch that failed before its
    logger wrote the state) the one its lock file names; None when neither says (a torn state is no record)."""
    try:
        record = json.loads((folder / STATE).read_text())
        return record.get("agent") if isinstance(record, dict) else None
    except FileNotFoundError:
        pass
    except (OSError, ValueError, RecursionError):
        return None
    try:
        with open(folder / LOCK, encoding="utf-8", errors="replace") as lock:
            found = re.match(r"pid \d+ on (\S+), torchrun agent (\d+),", lock.read(400))
    except OSError:
        return None
    return {"host": found[1], "pid": int(found[2])} if found else None


def sweep_finished_runs(own: str | os.PathLike[str]) -> int:
    """Remove this user's ``bagualu2-run-*`` folders in the temp directory (other than ``own``) whose run's
    torchrun agent on this host has exited, as recorded in their ``run_state.json`` or their lock file (a launch
    that failed during its set-up): a run without a checkpoint directory or metrics file that failed with no
    restart left (or was killed) leaves its folder, and a ``--standalone`` launch draws a new run id, so no later
    launch reads it. A folder without that record, of
    another user or host, of an agent still running, or whose lock a live rank 0 holds (a launch that reuses a run
    id, before it records its agent; another PID namespace) is kept. Returns how many were removed."""
    import fcntl

    removed = 0
    own_path = Path(own).resolve()
    host = os.uname().nodename
    for folder in Path(tempfile.gettempdir()).glob(f"{TEMP_PREFIX}*"):
        try:
            info = os.lstat(folder)
            if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or folder.resolve() == own_path):
                continue
        except OSError:
            continue
        agent = _recorded_agent(folder)
        if (not isinstance(agent, dict) or agent.get("host") != host or type(agent.get("pid")) is not int
                or _alive(agent["pid"])):
            continue
        try:
            with open(folder / LOCK, "a+") as lock:  # held while removing: a run starting in it waits, then remakes it
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # a live rank 0 holds the lock, or the lock file cannot be made: not ours to judge
            continue
        removed += not folder.exists()
    return removed


def marker_files(directory: Path) -> list[Path]:
    """The markers in ``directory`` that are regular files (anything else of that name is never removed: the
    run's set-up refuses it)."""
    return [path for pattern in MARKERS for path in sorted(directory.glob(pattern))
            if path.is_file() and not path.is_symlink()]


def _torn_writes(directory: Path, *, before: float) -> list[Path]:
    """The temp files of record writes (``_write_json``'s) that a killed process left in ``directory``, made
    before ``before`` (a later one may be another rank's write in progress)."""
    torn = []
    for pattern in (*MARKERS, STATE):
        for path in directory.glob(f".{pattern}.*"):
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode) and info.st_mtime < before:
                torn.append(path)
    return torn


class RunState:
    """The run's restart history in ``directory`` (None: nothing persisted, one launch only). ``fresh``: a new run
    (the history starts over); ``first_launch``: torchrun's first start of this launch, whose markers can only be
    left over from an earlier launch (a ``--resume`` after a kill), so they are removed; a ``--resume`` launch (not
    fresh, first launch) clears a ``stopped`` mark: the operator launched it on purpose."""

    def __init__(self, directory: str | None, *, fresh: bool, first_launch: bool = False):
        self.dir = Path(directory) if directory else None
        self.launched_at = time.time()
        self.data: dict[str, Any] = {"started_at": self.launched_at, "oom_events": 0, "stalls": 0, "restarts": 0,
                                     "restart_s": 0.0, "steps_lost": 0, "policies": [], "stopped": None}
        self.pending_error_at: float | None = None  # an OOM whose restart has not completed a step yet
        if self.dir is None:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / STATE
        if fresh or first_launch:
            for marker in marker_files(self.dir):
                marker.unlink(missing_ok=True)
        for torn in _torn_writes(self.dir, before=self.launched_at - 1.0):
            torn.unlink(missing_ok=True)
        if not fresh and path.is_file():
            try:
                state = json.loads(path.read_text())
            except (OSError, ValueError, RecursionError):
                state = None
            if isinstance(state, dict):  # anything else (null, a list, a torn file) is no state
                self.data.update(state)
        if first_launch and not fresh:
            self.data["stopped"] = None

    def launched(self, policy: str, *, fresh: bool, is_logger: bool) -> None:
        """A launch (not a torchrun restart) begins under ``policy``: a fresh run's history starts with it, a
        resumed one's continues; the logger rank writes the state."""
        policies = self.data["policies"]
        self.data["policies"] = [policy] if fresh else policies + [policy] if policies[-1:] != [policy] else policies
        self.data["restarts_before"] = self.data["restarts"]  # this launch's restarts count on from the run's
        self.data["agent"] = _agent()  # the same across this launch's restarts: sweep_finished_runs reads it
        if is_logger:
            self.save()

    def policy_in_force(self) -> str | None:
        """The policy the last launch ran (None: no history)."""
        return self.data["policies"][-1] if self.data["policies"] else None

    def markers(self, pattern: str = "oom-rank*.json") -> list[dict]:
        found = []
        for marker in sorted(self.dir.glob(pattern)) if self.dir else ():
            try:
                record = json.loads(marker.read_text())
            except (OSError, ValueError, RecursionError):
                continue
            if isinstance(record, dict) and isinstance(record.get("time"), (int, float)):
                found.append(record)
        return found

    def last_oom(self) -> dict | None:
        """The earliest marker of the incident that caused this restart (None: no OOM pending)."""
        markers = self.markers()
        return min(markers, key=lambda m: m["time"]) if markers else None

    def restarted(self, *, restart_count: int, resume_step: int, policy: str, is_logger: bool) -> dict | None:
        """Fold the OOM markers into the state (rank 0 writes it); returns the incident, if any."""
        markers = self.markers()  # read once: the logger rank deletes them below while the others read
        faults = self.markers("fault-rank*.json")
        incident = min(markers, key=lambda m: m["time"]) if markers else None
        self.data["restarts"] = max(self.data["restarts"], self.data.get("restarts_before", 0) + restart_count)
        self.pending_error_at = self.launched_at  # a rank killed outright: from this launch's start (lower bound)
        if incident is not None:
            incident = {**incident, "peak_activation_bytes": max(m.get("peak_activation_bytes", 0) for m in markers)}
            self.data["oom_events"] += 1
            self.data["steps_lost"] += max(incident["step"] - resume_step, 0)
            self.pending_error_at = incident["time"]
        elif faults:
            first = min(faults, key=lambda m: m["time"])
            self.data["stalls"] = self.data.get("stalls", 0) + 1
            done = first.get("done")  # the steps whose update was applied (a marker without it: its step)
            self.data["steps_lost"] += max((done if isinstance(done, int) else first["step"]) - resume_step, 0)
            self.pending_error_at = first["time"]
        self.data["policies"] = [*self.data["policies"], policy] if self.data["policies"][-1:] != [policy] else \
            self.data["policies"]
        if is_logger:
            self.save()
            for marker in marker_files(self.dir) if self.dir else ():
                marker.unlink(missing_ok=True)
        return incident

    def step_done(self, is_logger: bool) -> None:
        """After a completed step: close a pending restart (its seconds from the error to now)."""
        if self.pending_error_at is None:
            return
        self.data["restart_s"] += time.time() - self.pending_error_at
        self.pending_error_at = None
        if is_logger:
            self.save()

    def save(self) -> None:
        if self.dir is not None:
            _write_json(self.dir / STATE, self.data)

    def record_oom(self, *, rank: int, step: int, policy: str, message: str, peak_bytes: int = 0) -> None:
        """This rank ran out of memory (called right before it exits); ``peak_bytes``: the most activation bytes
        the launch's completed steps held on this rank (on the logger rank: on every rank; the failed step is lost,
        as in the simulator) — the steps the restart re-runs lose their records, not this."""
        if self.dir is not None:
            _write_json(self.dir / f"oom-rank{rank}.json", {"time": time.time(), "step": step, "rank": rank,
                                                           "policy": policy, "message": message,
                                                           "peak_activation_bytes": peak_bytes})

    def record_fault(self, *, rank: int, step: int, kind: str, message: str, done: int | None = None) -> None:
        """This rank stalled or lost a collective at ``step`` (called right before it exits); ``done``: the steps
        whose update was applied by then (``step`` + 1 in the step's records or its checkpoint)."""
        if self.dir is not None:
            _write_json(self.dir / f"fault-rank{rank}.json", {"time": time.time(), "step": step, "rank": rank,
                                                             "kind": kind, "message": message,
                                                             "done": step if done is None else done})

    def record_stop(self, *, step: int, message: str, is_logger: bool) -> None:
        """The run stopped on purpose at ``step`` (a non-finite loss): automatic restarts must not go on."""
        self.data["stopped"] = {"step": step, "message": message}
        if is_logger:
            self.save()
