"""Iteration-level simulation on top of the pure packages: spike traces and the per-micro-batch decision path
(Algorithm 1 budget -> cached greedy plan -> deferred MoE downgrade after the gate). Never imports torch."""

from .replay import ForwardDecision, IterationReplay, replay_iteration, spike_trace
from .runtime import Decision, DecisionPath

__all__ = ["Decision", "DecisionPath", "ForwardDecision", "IterationReplay", "replay_iteration", "spike_trace"]
