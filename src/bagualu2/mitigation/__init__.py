"""Mitigation planning (paper §V-A): plan IR, conflict checker, greedy (Algorithm 2), offload-prefix candidates,
exact CP-SAT, brute force.
Pure Python (OR-Tools for the exact baseline, imported on first use): never imports torch."""

import importlib

from ..costmodel.plan import Plan
from . import brute, greedy, prefix
from .conflicts import RULES, Violation, check_conflicts
from .solution import Solution, SolveStatus, check_budget, floor_plan


def __getattr__(name: str):
    if name == "exact":  # the CP-SAT baseline needs OR-Tools: imported on first use only
        return importlib.import_module(f"{__name__}.exact")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Plan", "RULES", "Solution", "SolveStatus", "Violation", "brute", "check_budget",
           "check_conflicts", "exact", "floor_plan", "greedy", "prefix"]
