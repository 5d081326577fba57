"""The collective-order checker (``BAGUALU2_CHECK_COLLECTIVES=1``).

Every member of a process group must issue the same collectives in the same order; otherwise the group deadlocks
or, worse, pairs unrelated data. With the checker on, each rank records, per process group (named by its global
ranks), the sequence of collectives it issues through ``torch.distributed`` — the op, the reduce op, the dtype and
the shape every member must agree on (all of it for symmetric ops; the trailing dimensions for an uneven
``all_to_all_single``; nothing for object collectives) — from any thread. After every step :meth:`check` compares
the groups' sequences with one small all-gather of a hash per group; a divergence raises
:class:`CollectiveOrderError` with one line naming the step, the group and the first differing collective on each
side (a second gather, of the sequences, only then). Point-to-point sends and receives (the pipeline's) are not
collectives and are not recorded.

The checker wraps the functions of the ``torch.distributed`` namespace (what the model, autograd's
``torch.distributed.nn.functional`` and DCP call) while it is installed, and puts them back on :meth:`close`.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

ENV = "BAGUALU2_CHECK_COLLECTIVES"
DIVERGENCE_EXIT_CODE = 78  # the collective order diverged: a bug; restarting does not help
OPS = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all_single", "all_to_all", "broadcast",
       "reduce", "reduce_scatter", "reduce_scatter_tensor", "gather", "scatter", "barrier", "all_gather_object",
       "gather_object", "broadcast_object_list", "scatter_object_list")
_UNEVEN = {"all_to_all_single"}  # dim 0 differs between members with uneven splits


class CollectiveOrderError(RuntimeError):
    """The members of a process group issued different collectives; the message is one line."""


def enabled() -> bool:
    return os.environ.get(ENV, "") not in ("", "0", "false", "False")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _signature(op: str, args: tuple, kwargs: dict) -> str:
    """What every member of the group must agree on for this call (module docstring)."""
    if op.endswith("_object") or op.endswith("_object_list") or op == "barrier":
        return op
    first = args[1] if op in ("all_gather", "all_to_all_single", "all_to_all", "reduce_scatter",
                              "all_gather_into_tensor", "reduce_scatter_tensor") and len(args) > 1 else \
        (args[0] if args else None)
    tensors = _tensors(first)
    shapes = []
    for t in tensors[:4]:
        shape = tuple(t.shape[1:]) if op in _UNEVEN else tuple(t.shape)
        shapes.append(f"{str(t.dtype).replace('torch.', '')}{list(shape)}")
    extra = ""
    reduce_op = kwargs.get("op", args[1] if op == "all_reduce" and len(args) > 1 else None)
    if reduce_op is not None:
        extra = f" {str(reduce_op).split('.')[-1]}"
    return f"{op}({', '.join(shapes)}{extra})"


class CollectiveRecorder:
    """Records the collectives this rank issues, per process group, and compares them after each step."""

    def __init__(self) -> None:
        self.sequences: dict[tuple[tuple[int, ...], str], list[str]] = {}  # (ranks, group name) -> signatures
        self.total = 0
        self.last: str | None = None
        self._lock = threading.Lock()
        self._paused = threading.local()
        self._original: dict[str, Callable] = {}

    # ---- recording ----------------------------------------------------------------------------------------------
    def install(self) -> "CollectiveRecorder":
        for op in OPS:
            original = getattr(dist, op, None)
            if original is None or op in self._original:
                continue
            self._original[op] = original
            setattr(dist, op, self._wrap(op, original))
        return self

    def close(self) -> None:
        for op, original in self._original.items():
            setattr(dist, op, original)
        self._original.clear()

    def _wrap(self, op: str, original: Callable) -> Callable:
        def recorded(*args, **kwargs):
            if not getattr(self._paused, "on", False):
                group = kwargs.get("group")
                if group is None:
                    group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
                self.record(op, group, _signature(op, args, kwargs))
            return original(*args, **kwargs)

        recorded.__wrapped__ = original  # type: ignore[attr-defined]
        recorded.__name__ = op
        return recorded

    def record(self, op: str, group, signature: str) -> None:
        group = group if group is not None else dist.group.WORLD
        key = (tuple(dist.get_process_group_ranks(group)), group.group_name)  # groups of one membership differ
        with self._lock:
            sequence = self.sequences.setdefault(key, [])
            sequence.append(signature)
            self.total += 1
            self.last = f"collective #{len(sequence)} {signature} on group {list(key[0])}"

    def describe(self) -> str:
        """The last collective this rank issued (for the watchdog's line)."""
        return f"last {self.last}" if self.last else "no collective issued this step"

    # ---- checking -----------------------------------------------------------------------------------------------
    def check(self, step: int) -> None:
        """Compare every group's sequence of this step between its members (collective over the world); then
        start the next step's sequences. Raises :class:`CollectiveOrderError` on every rank alike."""
        with self._lock:
            sequences, self.sequences = self.sequences, {}
        digests = {key: (len(seq), hashlib.sha256("\n".join(seq).encode()).hexdigest()[:16])
                   for key, seq in sequences.items()}
        world = dist.get_world_size()
        self._paused.on = True
        try:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, digests)
            diverged = sorted({key for key in {k for d in gathered for k in d}
                               if len({gathered[m].get(key) for m in key[0]}) > 1})
            if not diverged:
                return
            full: list[Any] = [None] * world
            dist.all_gather_object(full, {key: sequences.get(key, []) for key in diverged})
        finally:
            self._paused.on = False
        raise CollectiveOrderError(first_difference(step, diverged[0], full))


def first_difference(step: int, key: tuple[tuple[int, ...], str], sequences: list[dict]) -> str:
    """One line: the first collective where the members of group ``key`` (its ranks, its name) differ."""
    ranks = key[0]
    seqs = {member: sequences[member].get(key, []) for member in ranks}
    base_rank = ranks[0]
    base = seqs[base_rank]
    for member in ranks[1:]:
        other = seqs[member]
        for index in range(max(len(base), len(other))):
            mine = base[index] if index < len(base) else "nothing"
            theirs = other[index] if index < len(other) else "nothing"
            if mine != theirs:
                return (f"collective order diverged at step {step} in group {list(ranks)}: collective #{index + 1} "
                        f"is {mine} on rank {base_rank} but {theirs} on rank {member}")
    return f"collective order diverged at step {step} in group {list(ranks)}"
