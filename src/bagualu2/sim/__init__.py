"""The paper-scale simulator: seeded imbalance traces (:func:`paper_trace`) or the
trainer's log (:func:`load_trace`), the policies (``POLICIES``: flexible, static-under, static-over, kwai, adapipe,
ideal, oracle; the ablation levels ``ABLATION``: L1-L4) and :func:`simulate` — whole iterations of every pipeline
stage on one execution model (:mod:`.execution`) with OOMs, restarts and MFU; :mod:`.reproduce` regenerates docs/reproduction.md. docs/sim.md has the formulas and measured
numbers. Never imports torch."""

from .execution import OVERLAP
from .policies import ABLATION, FALLBACKS, POLICIES, StagePolicy, check_policy, make_policy, native_execution
from .simulate import ON_OOM, IterationResult, SimConfig, SimResult, check_trace, simulate
from .stage import Choice, StageContext
from .traces import PaperTrace, load_trace, paper_trace

__all__ = ["ABLATION", "ON_OOM", "Choice", "FALLBACKS", "IterationResult", "OVERLAP", "POLICIES", "PaperTrace", "SimConfig",
           "SimResult", "StageContext", "StagePolicy", "check_policy", "check_trace", "load_trace", "make_policy",
           "native_execution", "paper_trace", "simulate"]
