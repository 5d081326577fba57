"""What an iteration spends outside the stages' chunk steps, per pipeline stage, and the model FLOPs of the
output layer — the parts of a training step the op graphs of the transformer layers do not hold.

* **Output layer and embedding.** The last stage runs the output layer (a column-parallel GEMM of the
  micro-batch's tokens against ``vocab / tp`` rows) and the cross-entropy on its fp32 logits for every
  micro-batch; the first stage the embedding lookup. Roofline times on the hardware profile, like every op of the
  graphs (``peak_flops * matmul_efficiency``, ``hbm_bytes_per_s``): forward = the GEMM and three passes over the
  logits (write, softmax read and write), backward = twice the GEMM and two passes; the lookup moves its output
  once forward and a fp32 gradient once backward.
* **Gradient reduction** (Megatron's distributed optimizer with ``--overlap-grad-reduce`` and
  ``--overlap-param-gather``; without it an all-reduce of twice the volume): the fp32 gradients are
  reduce-scattered over the data-parallel group (dense
  parameters over ``dp``, experts over ``edp``), ring volume ``(n - 1) / n`` of them, at the inter-node rate times
  ``link_efficiency``; the reduction starts when the last micro-batch's backwards make the gradients final, so
  it hides behind them (and, on the pipeline's timeline, the stage's waits after them) and only the rest is
  exposed (``StageOverheads.sync_s``). The bf16 parameter all-gather after the step hides behind the first
  micro-batch's forwards (and the waits before them) the same way.
* **Optimizer step**: Adam over this rank's shard of the fp32 master parameters, memory-bound: per parameter it
  reads the master weight, gradient, momentum and variance (16 bytes), writes the three states back (12) and the
  bf16 weight (2).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..costmodel import Hardware, ModelConfig, ParallelConfig
from ..costmodel.memory import stage_parameters
from ..costmodel.strategy import roofline_s

ADAM_BYTES_PER_PARAMETER = 30  # read 16 (weight, grad, m, v in fp32), write 12 (weight, m, v) + 2 (bf16 copy)
GRAD_BYTES = 4                 # fp32 main gradients (Megatron's default gradient accumulation)


@dataclass(frozen=True)
class StageOverheads:
    """Seconds one rank of a stage spends per iteration outside its chunk steps: per micro-batch the output layer
    and cross-entropy after the last chunk's forward and before its backward (``head_forward_s``,
    ``head_backward_s``; the last stage) and the embedding before the first chunk's forward and after its backward
    (``embed_forward_s``, ``embed_backward_s``; the first stage); ``reduce_s`` and ``gather_s`` (the whole
    gradient reduce-scatter and parameter all-gather, before overlap), ``optimizer_s``; ``head_flops`` the output
    layer's model FLOPs per iteration (3 x forward); ``num_microbatches`` per iteration."""

    head_forward_s: float
    head_backward_s: float
    embed_forward_s: float
    embed_backward_s: float
    reduce_s: float
    gather_s: float
    optimizer_s: float
    head_flops: int
    num_microbatches: int

    @property
    def head_s(self) -> float:
        """The output layer, cross-entropy and embedding over all micro-batches of an iteration."""
        return (self.head_forward_s + self.head_backward_s + self.embed_forward_s
                + self.embed_backward_s) * self.num_microbatches

    def sync_s(self, last_backward_s: float, first_forward_s: float) -> float:
        """What the gradient synchronisation and the optimizer step add to the stage's iteration when the
        reduction hides behind ``last_backward_s`` and the gather behind ``first_forward_s``."""
        return (max(0.0, self.reduce_s - last_backward_s) + max(0.0, self.gather_s - first_forward_s)
                + self.optimizer_s)


def _ring_s(hardware: Hardware, nbytes: float, group: int) -> float:
    if group <= 1 or nbytes <= 0:
        return 0.0
    rate = hardware.inter_node_bytes_per_s * hardware.link_efficiency  # a data-parallel group spans nodes
    return hardware.kernel_launch_s + nbytes * (group - 1) / group / rate


def stage_overheads(model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, stage: int
                    ) -> StageOverheads:
    """The :class:`StageOverheads` of one rank of ``stage``."""
    tokens = model.seq_length * model.micro_batch_size // parallel.cp
    width = model.dtype_bytes
    head = [0.0, 0.0]
    embed = [0.0, 0.0]
    head_flops = 0
    if stage == parallel.pp - 1:
        flops = 2 * tokens * model.hidden_size * model.vocab_size // parallel.tp
        logits = 4 * tokens * model.vocab_size // parallel.tp
        weight = width * model.hidden_size * model.vocab_size // parallel.tp
        head = [roofline_s(hardware, flops, 3 * logits + weight),
                roofline_s(hardware, 2 * flops, 2 * logits + 2 * weight)]
        head_flops = 3 * flops * parallel.num_microbatches
    if stage == 0:
        out = width * tokens * model.hidden_size // parallel.tp
        embed = [roofline_s(hardware, 0, out), roofline_s(hardware, 0, 2 * out)]
    dense, expert = stage_parameters(model, parallel, stage=stage)
    edp = parallel.expert_data_parallel
    reduce_s = _ring_s(hardware, GRAD_BYTES * dense, parallel.dp) + _ring_s(hardware, GRAD_BYTES * expert, edp)
    gather_s = _ring_s(hardware, width * dense, parallel.dp) + _ring_s(hardware, width * expert, edp)
    if not parallel.distributed_optimizer:  # an all-reduce (twice the ring volume), no gather
        reduce_s, gather_s = 2 * reduce_s, 0.0
    shard = dense / parallel.dp + expert / edp if parallel.distributed_optimizer else dense + expert
    optimizer_s = ADAM_BYTES_PER_PARAMETER * shard / hardware.hbm_bytes_per_s
    return StageOverheads(*head, *embed, reduce_s, gather_s, optimizer_s, head_flops, parallel.num_microbatches)
