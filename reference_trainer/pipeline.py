"""Pipeline stages cut from the GLM-MoE model and the two schedules that run them (torch.distributed.pipelining).

Stage ``s = chunk * pp + pp_rank`` (Megatron interleaving, ``bagualu2.costmodel.chunk_layers``) holds its layers,
plus the embedding (``s = 0``) and the final norm and output layer (the last stage). Its forward runs the layers
inside the rank's :class:`~reference_trainer.provision.Provisioner` (budget -> plan -> gates -> kept bytes), and an
identity at its input reports the end of its backward (the micro-batch's activations are released).

``schedule="runtime"``: a ``_PipelineScheduleRuntime`` runs the action list of ``bagualu2.costmodel.schedule``
(Megatron's 1F1B / interleaved 1F1B order, the one the budgets assume) in which every steady forward/backward
pair of different micro-batches is one ``OVERLAP_F_B`` action. Custom functions: ``FORWARD`` sets the micro-batch's
plan before the forward; ``OVERLAP_F_B`` runs F_x and B_y through the ``DualBatchExecutor`` in the fusion DP's
order (a baseline policy: Megatron-Core's), with the offload of x-1 (O) and the recovery of y+1 (R) inside
it. ``schedule="plain"``: the stock
``Schedule1F1B`` / ``ScheduleInterleaved1F1B`` (each forward still provisioned; no fusion).

Private pipelining APIs used (pinned torch range in pyproject.toml): ``_Action``, ``_PipelineScheduleRuntime``,
``_wait_batch_p2p``, ``_prepare_schedule_with_comms``, and the runtime's ``_maybe_compute_loss``,
``_maybe_get_loss``, ``fwd_recv_ops`` / ``bwd_recv_ops``, ``backward_counter``, ``_n_microbatches``, ``_stages``
(what its own FORWARD / OVERLAP_F_B handlers use).
"""

from __future__ import annotations

import logging

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as S
from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, OVERLAP_F_B

from bagualu2.costmodel import ParallelConfig, points
from bagualu2.costmodel.build import chunk_layers

from .chunks import ChunkModule
from .model import GLMMoEModel
from .provision import Provisioner



def _not_the_failure_table(record: logging.LogRecord) -> bool:
    """A failed action makes torch's schedule log the whole action table (about 20 lines) on every rank before it
    re-raises; the trainer reports each failure in one line of its own (a defect: its traceback). Its other
    records pass."""
    return not (record.levelno >= logging.ERROR and record.funcName == "_step_microbatches")


logging.getLogger(S.__name__).addFilter(_not_the_failure_table)


def runtime_actions(parallel: ParallelConfig) -> dict[int, list[S._Action]]:
    """Every pp rank's compute actions: the cost model's schedule, steady (F, B) pairs of different
    micro-batches as ``OVERLAP_F_B``."""
    def action(step, rank: int) -> S._Action:
        return S._Action(step.chunk * parallel.pp + rank, FORWARD if step.kind == "F" else FULL_BACKWARD,
                         step.microbatch)

    return {rank: [action(group[0], rank) if len(group) == 1
                   else S._Action(-1, OVERLAP_F_B, None, tuple(action(step, rank) for step in group))
                   for group in points(parallel, rank)]
            for rank in range(parallel.pp)}


def build_stages(model: GLMMoEModel, parallel: ParallelConfig, *, pp_rank: int, provisioner: Provisioner,
                 device: torch.device, group, micro_batch_shape: tuple[int, int]) -> list[PipelineStage]:
    """This rank's ``vp`` pipeline stages (explicit input/output shapes: no shape inference)."""
    config = model.config
    b, s = micro_batch_shape
    num_stages = parallel.pp * parallel.vp
    from .model import TORCH_DTYPES

    dtype = TORCH_DTYPES[config.dtype]
    stages = []
    for chunk in range(parallel.vp):
        index = chunk * parallel.pp + pp_rank
        layers = chunk_layers(config, parallel, stage=pp_rank, chunk=chunk)
        module = ChunkModule(model, stage_index=index, num_stages=num_stages, chunk=chunk, layers=layers,
                             provisioner=provisioner)
        inputs = (torch.zeros(b, s, dtype=torch.long, device=device) if index == 0
                  else torch.zeros(b, s, config.hidden_size, dtype=dtype, device=device, requires_grad=True))
        width = config.vocab_size if index == num_stages - 1 else config.hidden_size
        outputs = torch.zeros(b, s, width, dtype=dtype, device=device, requires_grad=True)
        stages.append(PipelineStage(module, index, num_stages, device, input_args=inputs, output_args=outputs,
                                    group=group))
    return stages


class RuntimeSchedule:
    """The ``runtime`` schedule of one rank: the generated action list and its custom functions."""

    def __init__(self, stages: list[PipelineStage], parallel: ParallelConfig, *, loss_fn, provisioner: Provisioner):
        self.parallel, self.provisioner = parallel, provisioner
        self.schedule = S._PipelineScheduleRuntime(stages, parallel.num_microbatches, loss_fn=loss_fn)
        self.orders = runtime_actions(parallel)
        self.schedule.pipeline_order = self.orders
        self.schedule._prepare_schedule_with_comms(self.orders)
        self.schedule.register_custom_function(FORWARD, self._forward)
        self.schedule.register_custom_function(OVERLAP_F_B, self._overlap)
        self.rank = stages[0].group_rank
        self._neighbours = self._point_neighbours(self.orders[self.rank])

    def step(self, *args, **kwargs):
        return self.schedule.step(*args, **kwargs)

    @staticmethod
    def _point_neighbours(actions: list[S._Action]) -> dict[int, tuple]:
        """Per OVERLAP action position: (previous forward, next backward) as (stage index, micro-batch) or None."""
        flat = []
        for action in actions:
            flat.extend(action.sub_actions if action.computation_type == OVERLAP_F_B else (action,))
        found = {}
        position = 0
        for number, action in enumerate(actions):
            if action.computation_type == OVERLAP_F_B:
                forwards = [a for a in flat[:position] if a.computation_type == FORWARD]
                backwards = [a for a in flat[position + 2:] if a.computation_type == FULL_BACKWARD]
                previous = (forwards[-1].stage_index, forwards[-1].microbatch_index) if forwards else None
                following = (backwards[0].stage_index, backwards[0].microbatch_index) if backwards else None
                found[(action.sub_actions[0].stage_index, action.sub_actions[0].microbatch_index)] = (previous,
                                                                                                      following)
                position += 2
            else:
                position += 1
        return found

    def _stage(self, ctx, index: int):
        for stage in ctx.schedule_ref._stages:
            if stage.stage_index == index:
                return stage
        raise AssertionError(f"stage {index} is not on this rank")

    def _chunk(self, index: int) -> int:
        return index // self.parallel.pp

    def _forward(self, action: S._Action, ctx) -> None:
        schedule, stage, mb = ctx.schedule_ref, self._stage(ctx, action.stage_index), action.microbatch_index
        if not stage.is_first:
            S._wait_batch_p2p(schedule.fwd_recv_ops.pop((action.stage_index, mb)))
        self.provisioner.flush_offloads()
        self.provisioner.prepare(self._chunk(action.stage_index), mb)
        output = stage.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb])
        schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)

    def _overlap(self, action: S._Action, ctx) -> None:
        schedule = ctx.schedule_ref
        forward, backward = action.sub_actions
        f_stage, b_stage = self._stage(ctx, forward.stage_index), self._stage(ctx, backward.stage_index)
        x, y = forward.microbatch_index, backward.microbatch_index
        if not f_stage.is_first:
            S._wait_batch_p2p(schedule.fwd_recv_ops.pop((forward.stage_index, x)))
        if not b_stage.is_last:
            S._wait_batch_p2p(schedule.bwd_recv_ops.pop((backward.stage_index, y)))
        previous, following = self._neighbours[(forward.stage_index, x)]
        as_chunk = (lambda pair: None if pair is None else (self._chunk(pair[0]), pair[1]))

        def run_forward():
            output = f_stage.forward_one_chunk(x, ctx.arg_mbs[x], ctx.kwarg_mbs[x])
            schedule._maybe_compute_loss(f_stage, output, ctx.target_mbs, x)

        def run_backward():
            schedule.backward_counter[backward.stage_index] += 1
            last = schedule.backward_counter[backward.stage_index] == schedule._n_microbatches
            b_stage.backward_one_chunk(y, loss=schedule._maybe_get_loss(b_stage, y), full_backward=True,
                                       last_backward=last)

        self.provisioner.point(forward=(self._chunk(forward.stage_index), x),
                               backward=(self._chunk(backward.stage_index), y), previous=as_chunk(previous),
                               following=as_chunk(following), run_forward=run_forward, run_backward=run_backward)


def plain_schedule(stages: list[PipelineStage], parallel: ParallelConfig, *, loss_fn):
    """The stock schedule (no fusion)."""
    if parallel.vp == 1:
        return S.Schedule1F1B(stages[0], parallel.num_microbatches, loss_fn=loss_fn)
    return S.ScheduleInterleaved1F1B(stages, parallel.num_microbatches, loss_fn=loss_fn)
