"""The runtime decision path of one pipeline stage (paper §V-A "Deferred Planning", Algorithm 1, §V-B "Runtime
Solving"): budget -> pre-gate plan -> the one after-gate decision (keep / absorb / graded re-plan / full
downgrade) -> fused order, over one stage engine (``Stage``: the stage's steps, graphs and one bounded memo) and
one iteration driver (``run_iteration``). The trainer, the simulator and ``exec``'s deferred planner call it. Pure
Python: never imports torch."""

from .buckets import ceil_bucket, floor_bucket
from .gate import (DOWNGRADES, GateAction, GateDecision, after_gate, after_router_tensors, check_downgrade,
                   downgrade_plan, gate_free_tensors, unmade_after_router)
from .iteration import Forward, Iteration, IterationRun, run_iteration
from .path import DecisionPath
from .records import Decision
from .point import PointOrders
from .replay import ForwardDecision, IterationReplay, replay_iteration, spike_trace
from .stage import Memo, Stage, Step, TracedStage

__all__ = ["DOWNGRADES", "Decision", "DecisionPath", "Forward", "ForwardDecision", "GateAction", "GateDecision",
           "Iteration", "IterationReplay", "IterationRun", "Memo", "PointOrders", "Stage", "Step", "TracedStage", "after_gate",
           "after_router_tensors", "ceil_bucket", "check_downgrade", "downgrade_plan", "floor_bucket",
           "gate_free_tensors", "replay_iteration", "run_iteration", "spike_trace", "unmade_after_router"]
