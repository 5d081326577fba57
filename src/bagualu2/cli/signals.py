"""A process that a signal ended: sent from outside (``kill``, the host's out-of-memory killer, a stopped launch) or
a crash of its own (SIGSEGV, SIGABRT, ...). Shared by ``bagualu2 train`` and its torchrun agent's wrapper; and
:func:`unwinding`, which lets a command that started other processes stop them when it is stopped."""

from __future__ import annotations

import contextlib
import signal
import threading

OUTSIDE = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})


def signal_name(number: int) -> str:
    """``SIGKILL`` for 9; ``signal 99`` for a number no signal has."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def how_it_ended(number: int, outside: str, crashed: str) -> str:
    """``was stopped by SIGKILL <outside>`` for a signal sent from outside, else ``crashed with SIGSEGV <crashed>``."""
    name = signal_name(number)
    return f"was stopped by {name} {outside}" if number in OUTSIDE else f"crashed with {name} {crashed}"


def _exit(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def unwinding(*signums: int):
    """Inside, each of ``signums`` (default SIGTERM and SIGHUP) raises ``SystemExit(128 + signal)`` in the main
    thread, so that ``finally`` and ``except BaseException`` blocks run — a command stops the processes it started
    and removes what it half made — and the exit code is the signal's; outside the main thread, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, _exit) for signum in (signums or (signal.SIGTERM, signal.SIGHUP))}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
