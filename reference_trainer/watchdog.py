"""No wait is unbounded: a step watchdog, and one line for a collective that failed.

Every rank runs a :class:`Watchdog` thread from its first step on. The training loop reports progress
(:meth:`Watchdog.beat` with a short label: the step, each micro-batch's forward and backward, the gradient
reduction, a checkpoint write); when a rank makes no progress for ``--collective-timeout`` seconds, its watchdog
writes every thread's stack to the rank's log (``faulthandler``), prints one line naming the rank, the step and
what it was doing (and, with the collective checker on, the last collective it issued), leaves a marker for the
restarted run's bookkeeping and exits with :data:`STALL_EXIT_CODE`. ``torchrun --max-restarts`` then restarts the
job, which resumes from its last complete checkpoint.

The same ``--collective-timeout`` is the process groups' timeout, so a collective whose peer died or stopped raises
on the live ranks at about the same time; :func:`collective_failure` recognises that error (anywhere in an
exception's chain) so the loop reports it in one line and exits with the same code instead of a traceback.

A stopped or killed rank cannot say so itself. Under torchrun every rank also publishes a heartbeat
(:class:`Heartbeats`: the time, its step and what it was doing) to the launch's store about once a second, from its
set-up on; the line
of a live rank whose collective failed or whose watchdog fired names the ranks whose heartbeat stopped (``rank 2
stopped answering 11 s ago (last heard at step 3, in the forward of c0.m1)``).
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from typing import Callable

import torch.distributed as dist

STALL_EXIT_CODE = 76  # no progress within --collective-timeout, or a collective failed: torchrun may restart
PEER_GONE_GRACE_S = 3.0  # a rank whose peer closed the connection lets the peer's own exit reach torchrun first
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def find_cause(exc: BaseException | None, matches: Callable[[BaseException], bool]) -> BaseException | None:
    """The first exception in ``exc``'s chain (causes, then contexts) that ``matches``, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if matches(exc):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _is_collective_failure(exc: BaseException) -> bool:
    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and any(mark in str(exc) for mark in (
        "gloo", "Gloo", "Connection closed by peer", "Connection reset by peer", "Timed out", "NCCL",
        "Broken pipe")))


def collective_failure(exc: BaseException | None) -> BaseException | None:
    """The failed collective (timeout, peer gone, connection closed) behind ``exc``, if any."""
    return find_cause(exc, _is_collective_failure)


def termination_signal(exc: BaseException | None) -> int | None:
    """The signal number behind ``exc`` when the launcher stopped this process by a signal that a handler turned into
    an exception (torchrun's agent raises one carrying ``sigval`` in the processes it forks), else ``None``."""
    found = find_cause(exc, lambda e: isinstance(getattr(e, "sigval", None), int))
    return None if found is None else int(found.sigval)


def exit_after_failure(failed: BaseException, line: str) -> None:
    """Print ``line`` and exit with :data:`STALL_EXIT_CODE`. When the peer closed the connection, the cause is the
    peer's (an out-of-memory exit with its own line, a kill): wait ``PEER_GONE_GRACE_S`` first, so that torchrun
    records the peer's exit as the job's first failure and stops this rank meanwhile — the launch then ends in the
    peer's line alone; a rank still running after the grace prints its own."""
    if any(mark in str(failed) for mark in PEER_GONE):
        time.sleep(PEER_GONE_GRACE_S)
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
    os._exit(STALL_EXIT_CODE)


class Watchdog:
    """Exits the process when :meth:`beat` is not called for ``timeout_s`` seconds (module docstring).

      timeout_s   seconds without progress that count as a stall (> 0).
      rank        the global rank named in the line.
      describe    optional callable giving more context for the line (e.g. the last collective issued).
      on_stall    called with the line before the process exits (e.g. to leave a marker); errors ignored.
    """

    def __init__(self, *, timeout_s: float, rank: int, describe: Callable[[], str] | None = None,
                 on_stall: Callable[[str, int], None] | None = None, exit_code: int = STALL_EXIT_CODE,
                 heartbeats: "Heartbeats | None" = None):
        if not timeout_s > 0:
            raise ValueError(f"--collective-timeout must be > 0 seconds, got {timeout_s!r}")
        self.timeout_s, self.rank, self.describe, self.on_stall = float(timeout_s), rank, describe, on_stall
        self.exit_code = exit_code
        self.heartbeats = heartbeats
        self.step = -1
        self.label = "starting"
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="bagualu2-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._last = time.monotonic()
        self._thread.start()  # the heartbeats (read by the line, stopped with the watchdog) start with the set-up
        return self

    def beat(self, label: str, step: int | None = None) -> None:
        """Progress: ``label`` says what the rank starts doing now."""
        if step is not None:
            self.step = step
        self.label = label
        self._last = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        if self.heartbeats is not None:
            self.heartbeats.stop()

    def _watch(self) -> None:
        poll_s = min(1.0, self.timeout_s / 10)
        while not self._stop.wait(poll_s):
            idle_s = time.monotonic() - self._last
            if idle_s >= self.timeout_s:
                self._stalled(idle_s)

    def _stalled(self, idle_s: float) -> None:
        context = ""
        if self.describe is not None:
            try:
                context = self.describe()
            except Exception:  # noqa: BLE001 - the report must go out whatever the context does
                context = ""
        silent = self.heartbeats.silent() if self.heartbeats is not None else ""
        context = "; ".join(part for part in (context, silent) if part)
        idle = f"{idle_s:.1f}" if idle_s < 10 else f"{idle_s:.0f}"  # a timeout below a second reads as such
        line = (f"error: rank {self.rank} made no progress for {idle} s (--collective-timeout "
                f"{self.timeout_s:g}) at step {self.step} in {self.label}{'; ' + context if context else ''}; "
                f"stacks above; exit code {self.exit_code} (torchrun --max-restarts restarts from the last "
                "complete checkpoint)")
        try:
            sys.stderr.write(f"watchdog: rank {self.rank}: stacks of every thread:\n")
            sys.stderr.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except Exception:  # noqa: BLE001
            pass
        if self.on_stall is not None:
            try:
                self.on_stall(line, self.step)
            except Exception:  # noqa: BLE001
                pass
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
        os._exit(self.exit_code)


class Heartbeats:
    """Every rank's heartbeat in the launch's ``store`` (see the module docstring): :meth:`start` publishes what
    ``source`` says (step, label) every ``period_s`` from a thread of its own (a store that stops answering never
    holds up the watchdog), :meth:`silent` names the ranks whose heartbeat is older than ``stale_s``. Store errors
    are ignored: a heartbeat is a diagnosis, never a reason to fail. The ages compare wall clocks, so across nodes
    they assume synchronised clocks."""

    def __init__(self, store, *, rank: int, world_size: int, period_s: float = 1.0, stale_s: float = 3.0,
                 answer_s: float = 2.0):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.period_s, self.stale_s, self.answer_s = period_s, stale_s, answer_s
        self._stop = threading.Event()
        self._started: float | None = None

    def start(self, source: Callable[[], tuple[int, str]]) -> None:
        """Publish what ``source`` says from now on (a second call does nothing)."""
        if self._started is not None:
            return
        self._started = time.time()

        def run() -> None:
            while True:
                self.publish(*source())
                if self._stop.wait(self.period_s):
                    return

        threading.Thread(target=run, name="bagualu2-heartbeat", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def publish(self, step: int, label: str) -> None:
        try:
            self.store.set(f"heartbeat/{self.rank}", json.dumps([time.time(), step, label]))
        except Exception:  # noqa: BLE001
            pass

    def silent(self) -> str:
        """The other ranks whose heartbeat is older than ``stale_s`` (stopped, killed), as one clause; "" if none,
        or if the store does not answer within ``answer_s``."""
        found: list[str] = []
        reader = threading.Thread(target=self._read, args=(found,), daemon=True)
        reader.start()
        reader.join(self.answer_s)
        return "; ".join(found) if not reader.is_alive() else ""

    def _read(self, found: list[str]) -> None:
        now = time.time()
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            key = f"heartbeat/{rank}"
            try:
                if not self.store.check([key]):  # the first beat comes with a rank's set-up, after its flags agree
                    if self._started is not None and now - self._started > self.stale_s:
                        found.append(f"rank {rank} was never heard from (it stopped before its set-up, or during "
                                     "it)")
                    continue
                at, step, label = json.loads(self.store.get(key))
            except Exception:  # noqa: BLE001
                continue
            if now - at > self.stale_s:
                where = f"at step {step}, in {label}" if step >= 0 else f"in {label}"
                found.append(f"rank {rank} stopped answering {now - at:.0f} s ago (last heard {where})")
