"""Fault injection for recovery tests and chaos runs: ``BAGUALU2_FAULTS``.

A comma-separated list of ``KIND@STEP[:rank=R][:at=POINT][:launch=N][:for=S]``; each fault fires once, at step ``STEP``
on rank ``R`` (default 0) in launch ``N`` of the job (``TORCHELASTIC_RESTART_COUNT``, default 0: a restarted
job runs clean). The faults are real: signals to this process, an ``OSError`` from the checkpoint writer, a
non-finite gradient, a collective issued differently.

  kill      SIGKILL this rank; ``at=forward`` (default: the step's second forward on this rank, mid-step) or
            ``at=checkpoint`` (after this rank's shards of the checkpoint written after the step, before it is
            complete) or ``at=saved`` (once that checkpoint is complete).
  stop      SIGSTOP this rank (a hang), at the same points; ``for=S`` sends it SIGCONT after S seconds (a long
            pause: a swapping host, a frozen file system), so a stop torchrun has meanwhile asked to terminate
            ends at once instead of after torchrun's 30 s grace period.
  nan       this rank's gradients of the step become NaN (before the non-finite check).
  enospc    the checkpoint written after the step fails with ``OSError(ENOSPC)`` (a full disk) on this rank.
  eacces    the same with ``PermissionError(EACCES)`` (a directory that cannot be written).
  diverge   at the end of the step every rank issues one all-reduce on the world, this rank with another reduce op
            than the others: a collective-order divergence that completes (for the checker).
  raise     a ``RuntimeError`` from this rank's forward, at the same points as ``kill`` (a defect in the step): the
            rank prints its traceback and exits with code 1.

Example: ``BAGUALU2_FAULTS=kill@3:rank=1,nan@5`` (docs/trainer.md "Faults and recovery").
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
from dataclasses import dataclass

ENV = "BAGUALU2_FAULTS"
KINDS = ("kill", "stop", "nan", "enospc", "eacces", "diverge", "raise")
POINTS = ("forward", "checkpoint", "saved")


@dataclass(frozen=True, kw_only=True)
class Fault:
    """One injected fault (module docstring)."""

    kind: str
    step: int
    rank: int = 0
    at: str = "forward"
    launch: int = 0
    for_s: int = 0  # stop only: SIGCONT after this many seconds (0: stopped until killed)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{ENV}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.at not in POINTS:
            raise ValueError(f"{ENV}: at must be one of {', '.join(POINTS)}, got {self.at!r}")
        for name in ("step", "rank", "launch", "for_s"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{ENV}: {name} must be an integer >= 0, got {value!r}")
        if self.for_s and self.kind != "stop":
            raise ValueError(f"{ENV}: for= applies to stop only, got it on {self.kind!r}")


def parse(text: str) -> tuple[Fault, ...]:
    """The faults of a ``BAGUALU2_FAULTS`` value (ValueError naming the bad part)."""
    faults = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        head, *options = part.split(":")
        kind, sep, step = head.partition("@")
        if not sep or not step.isdigit():
            raise ValueError(f"{ENV}: {part!r} must look like KIND@STEP[:rank=R][:at=POINT][:launch=N][:for=S]")
        fields: dict = {"kind": kind, "step": int(step)}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in ("rank", "at", "launch", "for"):
                raise ValueError(f"{ENV}: {part!r}: unknown option {option!r} (rank=, at=, launch=, for=)")
            if key != "at" and not value.isdigit():
                raise ValueError(f"{ENV}: {part!r}: {key} must be an integer >= 0, got {value!r}")
            fields["for_s" if key == "for" else key] = value if key == "at" else int(value)
        faults.append(Fault(**fields))
    return tuple(faults)


class Faults:
    """The faults of this rank and launch; the trainer calls the hooks below at its points."""

    def __init__(self, faults: tuple[Fault, ...], *, rank: int, launch: int):
        self.faults = tuple(f for f in faults if f.launch == launch)
        self.rank = rank
        self._forwards: dict[int, int] = {}

    @classmethod
    def from_env(cls, *, rank: int, launch: int) -> "Faults":
        return cls(parse(os.environ.get(ENV, "")), rank=rank, launch=launch)

    def _matching(self, kind: str, step: int, at: str | None = None) -> list[Fault]:
        return [f for f in self.faults
                if f.kind == kind and f.step == step and f.rank == self.rank and (at is None or f.at == at)]

    def _mine(self, kind: str, step: int, at: str | None = None) -> bool:
        return bool(self._matching(kind, step, at))

    def _signal(self, step: int, at: str) -> None:
        if self._mine("raise", step, at):
            raise RuntimeError(f"{ENV}: raise@{step} at {at} on rank {self.rank}")
        if self._mine("kill", step, at):
            os.kill(os.getpid(), signal.SIGKILL)
        for fault in self._matching("stop", step, at):
            if fault.for_s:  # a process of its own wakes this one: a stopped process cannot
                subprocess.Popen(["sh", "-c", f"sleep {fault.for_s}; kill -CONT {os.getpid()}"],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                 start_new_session=True)
            os.kill(os.getpid(), signal.SIGSTOP)

    def forward(self, step: int) -> None:
        """Before a forward of ``step`` on this rank: the second one is mid-step."""
        count = self._forwards[step] = self._forwards.get(step, 0) + 1
        if count == 2:
            self._signal(step, "forward")

    def checkpoint_written(self, step: int) -> None:
        """After this rank wrote its shards of the checkpoint made after ``step``, before it is complete."""
        self._signal(step, "checkpoint")

    def checkpoint_saved(self, step: int) -> None:
        """After the checkpoint made after ``step`` is complete (renamed into place, older ones deleted)."""
        self._signal(step, "saved")

    def write_error(self, step: int) -> OSError | None:
        """The error the checkpoint writer raises after ``step`` on this rank, if any."""
        if self._mine("enospc", step):
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        if self._mine("eacces", step):
            return PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return None

    def poison(self, step: int, params) -> bool:
        """Make this rank's gradients NaN at ``step`` (True if it did)."""
        if not self._mine("nan", step):
            return False
        for _, parameter in params:
            if parameter.grad is not None:
                parameter.grad.fill_(float("nan"))
        return True

    def diverge(self, step: int) -> None:
        """The divergence of ``diverge`` faults at ``step`` (every rank takes part: it completes)."""
        if not any(f.kind == "diverge" and f.step == step for f in self.faults):
            return
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return
        op = dist.ReduceOp.MAX if self._mine("diverge", step) else dist.ReduceOp.SUM
        from .parallel import collective_device

        dist.all_reduce(torch.zeros(1, device=collective_device()), op=op)
