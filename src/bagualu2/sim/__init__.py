"""The paper-scale simulator (issue [sim]). Until it lands, the decision path's names that used to live here are
re-exported from :mod:`bagualu2.runtime` for one release. Never imports torch."""

from ..runtime import Decision, DecisionPath, ForwardDecision, IterationReplay, replay_iteration, spike_trace

__all__ = ["Decision", "DecisionPath", "ForwardDecision", "IterationReplay", "replay_iteration", "spike_trace"]
