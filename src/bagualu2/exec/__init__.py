"""The torch side of bagualu2 (the only package that imports torch): the activation tracker that measures what a
micro-batch keeps for backward and enforces a memory cap on CPU, and plan execution through saved-tensor hooks
(:func:`apply_plan`: KEEP, OFFLOAD and FP8 QUANTIZE; RECOMPUTE and the dual-batch executor are the open part of
issue #5)."""

from .apply import OP_SCOPE, MicroBatchRecord, PlanExecutor, apply_plan, op_scope, quantize_fp8
from .tracker import ActivationOutOfMemoryError, ActivationTracker, storage_bytes

__all__ = ["ActivationOutOfMemoryError", "ActivationTracker", "MicroBatchRecord", "OP_SCOPE", "PlanExecutor",
           "apply_plan", "op_scope", "quantize_fp8", "storage_bytes"]
