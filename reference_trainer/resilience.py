"""What keeps a training session from hanging or dying with a traceback: one :class:`Guard` per rank.

* **Progress** — :meth:`Guard.beat` feeds the step :class:`~.watchdog.Watchdog` (``--collective-timeout``).
* **Collective order** — with ``BAGUALU2_CHECK_COLLECTIVES=1`` a :class:`~.collectives.CollectiveRecorder`
  records every collective and :meth:`Guard.end_step` compares the groups' sequences after every step.
* **Failures** — :meth:`Guard.fatal` turns a failed collective (a peer died, stopped, timed out) or a diverged
  collective order into one line and a distinct exit code; :meth:`Guard.nonfinite` finds a non-finite loss or
  gradient on any rank (one all-reduce, so every rank decides alike); :meth:`Guard.save` writes a checkpoint and
  turns a write failure (a full disk, a directory that cannot be written) into one warning line.
* **Faults** — the ``BAGUALU2_FAULTS`` injections of :mod:`.faults` fire at these same points.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.distributed as dist

from . import checkpoint, collectives, startup
from .faults import Faults
from .parallel import collective_device
from .watchdog import STALL_EXIT_CODE, Heartbeats, Watchdog, collective_failure, exit_after_failure

NONFINITE_EXIT_CODE = 65  # EX_DATAERR: a non-finite loss or gradient under --on-nonfinite stop


def sums_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Per tensor, whether its sum (in at least fp32) is finite: a 1-d bool tensor, no host sync. True proves every
    entry finite (NaN and inf propagate through a sum); False may also be finite entries that overflow their sum."""
    if not tensors:
        return torch.ones(0, dtype=torch.bool)
    return torch.stack([t.sum(dtype=torch.promote_types(t.dtype, torch.float32)) for t in tensors]).isfinite()


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Whether every entry of every tensor is finite (a 0-d bool tensor): :func:`sums_finite` in one pass, then the
    tensors whose sum is not finite entry by entry."""
    sums = sums_finite(tensors)
    every = sums.all()
    if bool(every):
        return every
    return torch.stack([torch.isfinite(t).all() for t, ok in zip(tensors, sums.tolist()) if not ok]).all()


class Guard:
    """The rank's watchdog, collective checker and fault injections (module docstring)."""

    def __init__(self, *, timeout_s: float, rank: int, world_size: int, launch: int, run_state):
        self.rank, self.world_size, self.run_state = rank, world_size, run_state
        self.faults = Faults.from_env(rank=rank, launch=launch)
        self.recorder = (collectives.CollectiveRecorder().install()
                         if collectives.enabled() and dist.is_initialized() else None)
        self.heartbeats = (Heartbeats(startup.store(), rank=rank, world_size=world_size)
                           if dist.is_initialized() and world_size > 1 and "MASTER_ADDR" in os.environ else None)
        self.watchdog = Watchdog(timeout_s=timeout_s, rank=rank,
                                 describe=self.recorder.describe if self.recorder is not None else None,
                                 on_stall=self._stalled, heartbeats=self.heartbeats)
        self.watchdog.beat("the set-up")
        if self.heartbeats is not None:  # from the set-up on: a rank stopped there is named in the others' lines
            self.heartbeats.start(lambda: (self.watchdog.step, self.watchdog.label))
        self.step = 0
        self.done = 0  # the steps whose update is applied (a fault after step s's update loses s + 1 - resume)

    def start(self) -> None:
        self.watchdog.start()

    def close(self) -> None:
        self.watchdog.stop()
        if self.recorder is not None:
            self.recorder.close()

    # ---- progress -----------------------------------------------------------------------------------------------
    def beat(self, label: str, step: int | None = None) -> None:
        if step is not None:
            self.step = self.done = step
        self.watchdog.beat(label, step)

    def updated(self, step: int) -> None:
        """Step ``step``'s update is applied (or skipped on every rank alike): a fault from here on, in its records
        or its checkpoint, loses it too."""
        self.done = step + 1

    def forward(self, label: str) -> None:
        """A forward starts (the provisioner's progress hook)."""
        self.watchdog.beat(label)
        self.faults.forward(self.step)

    def _stalled(self, line: str, step: int) -> None:
        self.run_state.record_fault(rank=self.rank, step=step, kind="stall", message=line, done=self.done)

    # ---- failures -----------------------------------------------------------------------------------------------
    def fatal(self, exc: BaseException, step: int) -> None:
        """Exit in one line if ``exc`` is a failed collective or a diverged collective order; else return.
        ``step`` < 0: before the first step."""
        if isinstance(exc, collectives.CollectiveOrderError):
            if self.rank == 0:
                sys.stderr.write(f"error: {exc}; exit code {collectives.DIVERGENCE_EXIT_CODE}\n")
                sys.stderr.flush()
            os._exit(collectives.DIVERGENCE_EXIT_CODE)
        failed = collective_failure(exc)
        if failed is None:
            return
        message = " ".join(str(failed).split())[:300]
        silent = self.heartbeats.silent() if self.heartbeats is not None else ""
        where = f"at step {step} in" if step >= 0 else "in"  # no step yet: the set-up, the resume load
        line = (f"error: rank {self.rank}: a collective failed {where} {self.watchdog.label} "
                f"({type(failed).__name__}: {message}){'; ' + silent if silent else ''}; exit code "
                f"{STALL_EXIT_CODE} (torchrun --max-restarts restarts from the last complete checkpoint)")
        self.run_state.record_fault(rank=self.rank, step=step, kind="collective", message=line, done=self.done)
        self.watchdog.stop()  # its limit may pass while exit_after_failure waits for torchrun: one line, not two
        exit_after_failure(failed, line)

    def nonfinite(self, step: int, loss_sum: float, params) -> list[int]:
        """The ranks whose loss or gradients of ``step`` are not finite (the same list on every rank)."""
        self.faults.poison(step, params)
        grads = [p.grad for _, p in params if p.grad is not None]
        device = collective_device()

        def reduced(finite: torch.Tensor) -> list[float]:
            flags = torch.zeros(self.world_size, dtype=torch.float64, device=device)
            flags[self.rank] = float(not math.isfinite(loss_sum)) + (~finite).to(device, torch.float64)
            if dist.is_initialized():
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            return flags.tolist()  # the step's one host sync on the common path

        flags = reduced(sums_finite(grads).all())
        if any(flag > 0 for flag in flags):  # every rank sees it: a sum may overflow finite entries, look closer
            flags = reduced(all_finite(grads))
        return [rank for rank, flag in enumerate(flags) if flag > 0]

    def end_step(self, step: int) -> None:
        """After the step's last collective: the ``diverge`` fault, then the collective-order check."""
        self.faults.diverge(step)
        if self.recorder is not None:
            self.recorder.check(step)

    # ---- checkpoints --------------------------------------------------------------------------------------------
    def save(self, directory: str, step: int, state: dict, *, run: dict | None = None) -> str | None:
        """Write checkpoint ``step`` (collective; ``run`` as :func:`checkpoint.save` takes it); None, or the
        one-line warning of a write that failed (the previous checkpoint is intact and training continues)."""
        self.beat(f"the write of checkpoint step-{step:08d}")
        try:
            checkpoint.save(directory, step, state, write_error=self.faults.write_error(step - 1),
                            after_write=lambda: self.faults.checkpoint_written(step - 1), run=run)
        except checkpoint.CheckpointError as exc:
            return f"warning: {exc}; training continues"
        self.faults.checkpoint_saved(step - 1)
        return None
