"""The runtime decision path of one pipeline stage (paper §V-A "Deferred Planning", Algorithm 1, §V-B "Runtime
Solving"): budget -> pre-gate plan -> the one after-gate decision (keep / absorb / graded re-plan / full
downgrade) -> fused order, with the memo caches keyed by buckets. The trainer, the simulator and ``exec``'s
deferred planner call it. Pure Python: never imports torch."""

from .buckets import COVERED, BucketCache, Buckets, Lru, OrderCache, PlanCache, ceil_bucket, floor_bucket
from .gate import (DOWNGRADES, GateAction, GateDecision, after_gate, after_router_tensors, check_downgrade,
                   gate_free_tensors,
                   downgrade_plan)
from .path import Decision, DecisionPath
from .point import PointOrders
from .replay import ForwardDecision, IterationReplay, replay_iteration, spike_trace

__all__ = ["COVERED", "DOWNGRADES", "BucketCache", "Buckets", "Decision", "DecisionPath", "ForwardDecision",
           "GateAction", "GateDecision", "IterationReplay", "Lru", "OrderCache", "PlanCache", "PointOrders", "after_gate",
           "after_router_tensors", "ceil_bucket", "check_downgrade", "downgrade_plan", "floor_bucket", "gate_free_tensors", "replay_iteration",
           "spike_trace"]
