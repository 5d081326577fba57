"""Every rank agrees on the run before its first collective, and no worker outlives its launcher.

Under a launcher (``MASTER_ADDR`` / ``MASTER_PORT`` set, ``WORLD_SIZE`` > 1) each rank publishes, in the launch's
TCP store, either its parsed configuration or its user error (:func:`agree`). Every rank then reads all of them and
reaches the same verdict: a rank's bad flags, or ranks launched with different flags (``--seed`` on one node only;
paths too: every rank must be given the same ones), are one line from rank 0 (naming the rank and the flag) and
exit code 2 on every rank, before any process group exists. A rank that does not report within
``max(--collective-timeout, DEFAULT_TIMEOUT_S)`` ends the launch with ``watchdog.STALL_EXIT_CODE`` (rank 0 names
it).

:func:`one_thread_unless_told` gives a run one intra-op thread unless ``OMP_NUM_THREADS`` says otherwise, as torchrun
gives its workers. :func:`die_with_launcher` asks Linux to kill this worker when its launcher (torchrun's agent)
dies, even by ``SIGKILL``: otherwise the workers of a killed launch would keep training, or waiting, as orphans.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
import json
import os
import signal
import sys
from typing import Any, Mapping, NoReturn

PR_SET_PDEATHSIG = 1  # linux/prctl.h
DEFAULT_TIMEOUT_S = 600.0  # the store's; and the agreement's when this rank's flags are bad (no --collective-timeout)
REPORTED_WAIT_S = 30.0  # how long the other ranks wait for rank 0's line before they exit
_KEY = "startup/"
_store_cache: list = []  # torch.distributed is imported on first use: --help and --world-size stay fast


def launched() -> bool:
    """Whether this process is one rank of a multi-process launch with a store to agree through."""
    return (int(os.environ.get("WORLD_SIZE", "1")) > 1 and "MASTER_ADDR" in os.environ
            and "MASTER_PORT" in os.environ)


def store():
    """The launch's TCP store (torchrun's agent's, or rank 0's, which does not wait for the others to connect) with a
    prefix per restart: a restarted worker group must not read the keys (peer addresses, verdicts) its failed
    predecessor left. One per process; connecting and reads wait up to ``DEFAULT_TIMEOUT_S``."""
    if not _store_cache:
        import torch.distributed as dist

        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                             is_master=not agent and rank == 0, timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S),
                             wait_for_workers=False)
        _store_cache.append(dist.PrefixStore(f"bagualu2/restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/",
                                             base))
    return _store_cache[0]


def die_with_launcher() -> None:
    """Under torchrun: SIGKILL this worker when the process that started it dies (Linux; elsewhere nothing)."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the launcher's own signal handling still stops the workers
        return
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def one_thread_unless_told() -> None:
    """One intra-op thread unless ``OMP_NUM_THREADS`` says otherwise: what torchrun gives each worker, so a
    one-process run computes as every rank of a launch does (on a CPU the recipes' small operators run several
    times faster on one thread than on every core, most of all on a busy machine)."""
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(1)


def fingerprint(config: Any) -> dict:
    """What every rank must agree on: the config's fields, JSON-able (nested dataclasses as dicts)."""
    return json.loads(json.dumps(dataclasses.asdict(config), sort_keys=True, default=str))


def verdict(reports: Mapping[int, dict], flags: Mapping[str, str]) -> str | None:
    """The error every rank reaches from all ranks' ``reports`` (``{"error": line}`` or ``{"config": dict}``), or
    None when they agree. ``flags`` names a config field's flag (``{"seed": "--seed"}``)."""
    for rank in sorted(reports):
        if "error" in reports[rank]:
            line = reports[rank]["error"]
            return line if rank == 0 else f"rank {rank}: {line}"
    first = reports[min(reports)]["config"]
    for rank in sorted(reports):
        config = reports[rank]["config"]
        # the recipe first: another recipe changes many fields at once
        for field in sorted(set(first) | set(config), key=lambda name: (flags.get(name) != "--recipe", name)):
            if first.get(field) != config.get(field):
                name = flags.get(field, f"the recipe's {field}")
                return (f"the ranks were launched with different flags: {name} is {_show(first.get(field))} on rank "
                        f"{min(reports)} and {_show(config.get(field))} on rank {rank}; launch every rank with the "
                        "same flags")
    return None


def _show(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def agree(report: dict, flags: Mapping[str, str], timeout_s: float | None) -> None:
    """Publish this rank's ``report`` and return when every rank's agrees; otherwise exit (module docstring):
    code 2 with one line from rank 0 for a user error or different flags."""
    import torch.distributed as dist

    from .watchdog import STALL_EXIT_CODE

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # at least the store's own wait: ranks load their data at their own pace before they report (the collective
    # timeout bounds a step, often a few seconds)
    timeout = datetime.timedelta(seconds=max(timeout_s or 0.0, DEFAULT_TIMEOUT_S))
    try:
        shared = store()
    except (dist.DistError, RuntimeError) as exc:
        if rank == 0:
            sys.stderr.write(f"error: rank 0: cannot reach the launch's store at {os.environ['MASTER_ADDR']}:"
                             f"{os.environ['MASTER_PORT']} ({' '.join(str(exc).split())[:200]})\n")
        raise SystemExit(STALL_EXIT_CODE) from None
    shared.set(f"{_KEY}{rank}", json.dumps(report))
    keys = [f"{_KEY}{r}" for r in range(world)]
    try:
        shared.wait(keys, timeout)
    except (dist.DistError, RuntimeError):
        try:
            missing = [r for r, key in enumerate(keys) if not shared.check([key])]
        except (dist.DistError, RuntimeError):  # the store's host (rank 0) is gone: it reported, or nobody can
            raise SystemExit(STALL_EXIT_CODE) from None
        _exit(rank, f"rank(s) {', '.join(map(str, missing))} did not report their flags within "
              f"{timeout.total_seconds():g} s", STALL_EXIT_CODE)
    try:
        reports = {r: json.loads(shared.get(key)) for r, key in enumerate(keys)}
    except (dist.DistError, RuntimeError):  # the store's host (rank 0) is gone: its own exit tells why
        raise SystemExit(STALL_EXIT_CODE) from None
    line = verdict(reports, flags)
    if line is not None:
        _exit(rank, line, 2)


def _exit(rank: int, line: str, code: int) -> NoReturn:
    """One line from rank 0, then every rank exits with ``code``; the others wait (boundedly) for rank 0's line, since
    torchrun stops the remaining workers as soon as one exits with an error."""
    import torch.distributed as dist

    shared = store()
    if rank == 0:
        sys.stderr.write(f"error: {' '.join(line.split())}\n")
        sys.stderr.flush()
        shared.set(f"{_KEY}reported", "1")
    else:
        try:
            shared.wait([f"{_KEY}reported"], datetime.timedelta(seconds=REPORTED_WAIT_S))
        except (dist.DistError, RuntimeError):
            pass
    raise SystemExit(code)
