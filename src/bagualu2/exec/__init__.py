"""The torch side of bagualu2 (the only package that imports torch): the activation tracker that measures what a
micro-batch keeps for backward and enforces a memory cap on CPU; plan execution through saved-tensor hooks
(:func:`apply_plan`: KEEP, OFFLOAD on copy streams, FP8 QUANTIZE, RECOMPUTE by replaying ops in backward); the
deferred MoE downgrade after the gate; FLOP counting in the cost model's convention; the dual-batch executor; and
:func:`instrument`, which applies all of it from outside to a model of your own (op map, module hooks, a traced
:class:`~bagualu2.costmodel.OpGraph`)."""

from .apply import MicroBatchRecord, PlanExecutor, apply_plan
from .instrument import InstrumentedModel, UntracedSavingsWarning, instrument
from .trace import TraceResult
from .ops import OP_SCOPE, GateReport, after_gate, on_backward, op_scope, overlap_point, routed, run_op
from .deferred import DeferredPlanner
from .flops import flop_counter
from .packing import CopyEngine, HostPool, quantize_fp8
from .tracker import ActivationOutOfMemoryError, ActivationTracker, storage_bytes



def __getattr__(name: str):
    # the dual-batch executor (and with it bagualu2.fusion) loads on first use: most users never run a fused point
    if name in ("DualBatchExecutor", "PointAborted", "PointResult"):
        from . import dual

        return getattr(dual, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["ActivationOutOfMemoryError", "ActivationTracker", "CopyEngine", "DeferredPlanner", "DualBatchExecutor",
           "HostPool", "InstrumentedModel", "PointAborted", "TraceResult", "UntracedSavingsWarning", "instrument",
           "MicroBatchRecord", "OP_SCOPE", "PlanExecutor", "after_gate", "apply_plan",
           "flop_counter", "GateReport", "on_backward", "op_scope", "overlap_point", "quantize_fp8", "routed", "run_op",
           "storage_bytes"]
