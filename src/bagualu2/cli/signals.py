"""A process that a signal ended: sent from outside (``kill``, the host's out-of-memory killer, a stopped launch) or
a crash of its own (SIGSEGV, SIGABRT, ...). Shared by ``bagualu2 train`` and its torchrun agent's wrapper."""

from __future__ import annotations

import signal

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
