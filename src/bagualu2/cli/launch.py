"""``python -m bagualu2.cli.launch TORCHRUN-ARGS``: torchrun's own main, but a failed worker ends the launch with the
worker's exit code and nothing more — the worker has already reported its one-line error (rank 0 only), so
torchrun's traceback and failure summary are not printed. Everything else is torchrun's (rendezvous, restarts,
``--max-restarts``); its logs keep their levels except the one that repeats a worker's failure. A worker group that
failed only with one of :data:`FINAL_EXIT_CODES` is not restarted: the same launch would fail the same way again.
A worker killed from outside (a signal no rank reported) gets one line here, once no restart is left; started by
``bagualu2 train``, the agent stops (SIGTERM) when that command dies."""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import shutil
import signal
import sys
import tempfile

from .signals import how_it_ended

# The reference trainer's exit codes that a restart repeats: a user error (bad flags or data: 2), a non-finite
# loss or gradient under ``--on-nonfinite stop`` (65), a diverged collective order (78, a bug).
FINAL_EXIT_CODES = frozenset({2, 65, 78})


class _NoWorkerFailure(logging.Filter):
    """Drops the lines that only repeat a worker's failure (its exit code, the SIGTERM to its peers) or the signal
    that stopped the launch (the one line :func:`main` prints says it)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(repeat in message for repeat in ("failed (exitcode", "closing signal", "death signal"))


def _unraisable(info) -> None:
    """Ctrl-C inside an import's lock callback is reported as "Exception ignored in ..." with a traceback: the one
    line below says it already."""
    if not issubclass(info.exc_type, KeyboardInterrupt):
        sys.__unraisablehook__(info)


LAUNCHER_PID = "BAGUALU2_LAUNCHER_PID"  # set by ``bagualu2 train``: the process whose death stops this agent
PR_SET_PDEATHSIG = 1


def _stop_with_launcher() -> bool:
    """Started by ``bagualu2 train``: ask Linux for SIGTERM when that process dies (killed with SIGKILL, it cannot
    forward a signal), so torchrun's own handler stops the workers instead of leaving them training. False when
    the launcher is gone already."""
    launcher = os.environ.get(LAUNCHER_PID, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return True
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the forwarded SIGTERM / SIGINT / SIGHUP still stop it
        return True
    return os.getppid() == int(launcher)


def main(argv: list[str] | None = None) -> int:
    sys.unraisablehook = _unraisable
    if not _stop_with_launcher():
        return 128 + signal.SIGTERM
    argv = sys.argv[1:] if argv is None else list(argv)
    own_logs = None
    if not any(arg.split("=", 1)[0] in ("--log-dir", "--log_dir") for arg in argv):
        # torchrun's default is a new torchelastic_* folder in the temp directory per launch, left behind: the
        # workers' error files live in one of this launch's own, removed when the agent is done with them
        own_logs = tempfile.mkdtemp(prefix="bagualu2-torchelastic-")
        argv = ["--log-dir", own_logs, *argv]
    try:
        return _agent(argv)
    except KeyboardInterrupt:  # Ctrl-C before torchrun's own handlers stand (importing torch, the rendezvous)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the same Ctrl-C forwarded by ``bagualu2 train`` too
        print("stopped by signal 2; the workers were stopped", file=sys.stderr, flush=True)
        return 130
    finally:
        if own_logs is not None:
            shutil.rmtree(own_logs, ignore_errors=True)


def no_restart_after_final_failures(agent_class) -> None:
    """Wraps the agent's worker monitor: a failed round whose failures have final exit codes, the rest stopped by a
    signal, spends the remaining restarts, so torchrun stops there instead of launching the same failure again."""
    monitor = agent_class._monitor_workers
    if getattr(monitor, "final_exit_codes", None) is not None:
        return

    @functools.wraps(monitor)
    def wrapped(agent, worker_group):
        result = monitor(agent, worker_group)
        failures = getattr(result, "failures", None) or {}
        codes = [failure.exitcode for failure in failures.values()]
        # the others may have been stopped by the agent's own SIGTERM while they exited: killed by it (a negative
        # code) or exiting on it (128 + the signal, as the trainer does)
        if result.is_failed() and any(code in FINAL_EXIT_CODES for code in codes) and all(
                code in FINAL_EXIT_CODES or code < 0 or code > 128 for code in codes):
            agent._remaining_restarts = 0
        return result

    wrapped.final_exit_codes = FINAL_EXIT_CODES
    agent_class._monitor_workers = wrapped


def workers_start_with_sigint_held(agent_class) -> None:
    """Wraps the agent's worker start: the workers are forked with SIGINT blocked, so a Ctrl-C in their first
    milliseconds (the interpreter's own start-up, before any handler can stand: Python's "Fatal Python error:
    init_import_site" and a traceback) stays pending until the reference trainer unblocks it with its handler in
    place, and exits quietly. The agent's own mask is restored at once: its Ctrl-C arrives as before."""
    start = agent_class._start_workers
    if getattr(start, "holds_sigint", False):
        return

    @functools.wraps(start)
    def wrapped(agent, worker_group):
        held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return start(agent, worker_group)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)

    wrapped.holds_sigint = True
    agent_class._start_workers = wrapped


def _agent(argv: list[str]) -> int:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    for name in ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api"):
        logging.getLogger(name).addFilter(_NoWorkerFailure())
    no_restart_after_final_failures(LocalElasticAgent)
    if os.environ.get(LAUNCHER_PID, "").isdigit():  # ``bagualu2 train``: the workers are the reference trainer
        workers_start_with_sigint_held(LocalElasticAgent)
    try:
        torchrun_main(argv)
    except ChildFailedError as exc:
        codes = [failure.exitcode for failure in exc.failures.values()]
        if all(signal_of(code) is not None for code in codes):  # ended by signals: no rank reported it
            return report_killed(*exc.get_first_failure())
        return next((code for code in codes if signal_of(code) is None and code > 0), 1)
    except SignalException as exc:  # SIGTERM / SIGINT: torchrun has stopped the workers; no traceback
        print(f"stopped by signal {int(exc.sigval)}; the workers were stopped", file=sys.stderr, flush=True)
        return 128 + int(exc.sigval)
    return 0


def signal_of(code: int) -> int | None:
    """The signal a worker's exit code says ended it: killed by it (``-signal``) or exiting on it (128 + signal, as
    the trainer does when torchrun stops it); None for an exit code of its own."""
    if code < 0:
        return -code
    return code - 128 if 128 < code < 128 + signal.NSIG else None


def report_killed(rank: int, failure) -> int:
    """One line for a worker that a signal ended and that left no line of its own (killed from outside: ``kill``,
    the host's out-of-memory killer; or crashed: SIGSEGV, SIGABRT), once torchrun has no restart left; 128 + the
    signal's number."""
    number = signal_of(failure.exitcode)
    how = how_it_ended(number, "(from outside the trainer: kill, the host's out-of-memory killer)",
                       "(its output above says where)")
    print(f"error: rank {rank} {how} and no restart is left (--max-restarts)", file=sys.stderr, flush=True)
    return 128 + number


if __name__ == "__main__":
    sys.exit(main())
