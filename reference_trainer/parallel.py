"""Parallel wiring: world = pp x dp, expert parallelism carved out of the data-parallel ranks (Megatron-Core,
torchtitan).

Global rank ``r = pp_rank * dp + dp_rank`` (a ``("pp", "dp")`` mesh): the ``dp`` ranks of one pipeline stage are
consecutive. Every group is made with the run's collective timeout (``--collective-timeout``), so no collective
waits forever. The expert-parallel groups are consecutive runs of ``ep`` of them: DP rank ``d``
is EP rank ``d % ep`` of group ``d // ep`` and holds experts ``[(d % ep) * E/ep, (d % ep + 1) * E/ep)``. The
``dp / ep`` ranks holding the same experts form a *replica* group.

Gradients: the loss of each DP rank is the mean over its own tokens; the global loss is the mean over the ``dp``
ranks. Dense gradients are therefore averaged over ``dp``; an expert's gradient already sums what every rank of its
EP group sent it (the all-to-all's backward), so it is summed over its ``dp / ep`` replicas and divided by ``dp``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Groups:
    """This rank's place and process groups (None where a group would have one rank)."""

    rank: int
    world_size: int
    pp: int
    dp: int
    ep: int
    pp_rank: int
    dp_rank: int
    ep_rank: int
    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    ep_group: dist.ProcessGroup | None
    replica_group: dist.ProcessGroup | None

    @property
    def is_logger(self) -> bool:
        return self.rank == 0


def build_groups(*, pp: int, dp: int, ep: int, timeout_s: float = 600.0) -> Groups:
    """Create the pipeline, data-, expert-parallel and replica groups (collective: every rank calls it, creating
    every group in the same order), each with ``timeout_s``. Without an initialised process group: one process,
    no groups."""
    if not dist.is_initialized():
        return Groups(0, 1, 1, 1, 1, 0, 0, 0, None, None, None, None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != pp * dp:
        raise ValueError(f"the world size {world} must equal --pp x --dp = {pp * dp}")
    timeout = datetime.timedelta(seconds=timeout_s)
    pp_rank, dp_rank = divmod(rank, dp)
    mine: dict[str, dist.ProcessGroup | None] = {"pp": None, "dp": None, "ep": None, "replica": None}

    def make(kind: str, members: list[int]) -> None:
        group = dist.new_group(members, timeout=timeout) if len(members) > 1 else None
        if rank in members:
            mine[kind] = group

    for index in range(dp):
        make("pp", [stage * dp + index for stage in range(pp)])
    for stage in range(pp):
        base = stage * dp
        make("dp", list(range(base, base + dp)))
        for first in range(0, dp, ep):
            make("ep", list(range(base + first, base + first + ep)))
        for index in range(ep):
            make("replica", list(range(base + index, base + dp, ep)))
    return Groups(rank, world, pp, dp, ep, pp_rank, dp_rank, dp_rank % ep, mine["pp"], mine["dp"], mine["ep"],
                  mine["replica"])


def is_expert_parameter(name: str) -> bool:
    """Parameters of routed experts (``...mlp.experts.<i>...``); the shared expert and the router are dense."""
    return ".experts." in f".{name}"


def _all_reduce_flat(tensors: list[torch.Tensor], group, scale: float) -> None:
    if not tensors:
        return
    if group is None:  # nothing to reduce: scale in place (what the flat path computes, element for element)
        if scale != 1.0:
            for t in tensors:
                t.mul_(scale)
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


def reduce_gradients(named_parameters, groups: Groups) -> None:
    """Average dense gradients over dp; sum expert gradients over their replicas, divided by dp (module
    docstring). Parameters without a gradient get a zero one first, so every rank reduces the same tensors."""
    dense: dict[torch.dtype, list[torch.Tensor]] = {}
    expert: dict[torch.dtype, list[torch.Tensor]] = {}
    for name, parameter in named_parameters:
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        (expert if is_expert_parameter(name) else dense).setdefault(parameter.dtype, []).append(parameter.grad)
    scale = 1.0 / groups.dp
    for grads in dense.values():
        _all_reduce_flat(grads, groups.dp_group, scale)
    for grads in expert.values():
        _all_reduce_flat(grads, groups.replica_group, scale)


def collective_device(group=None) -> torch.device:
    """Where a small tensor for a collective on ``group`` (default: the world) lives: CUDA under NCCL, else CPU."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_max(values: list[float], group) -> list[float]:
    """Element-wise maximum over ``group`` (identity without one); float64, so byte counts up to 2**53 are exact."""
    if group is None:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()
