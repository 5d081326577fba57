"""Mitigation planning (paper §V-A): plan IR, conflict checker, greedy (Algorithm 2), exact CP-SAT, brute force,
plan cache. Pure Python (OR-Tools for the exact baseline): never imports torch."""

from ..costmodel.plan import Plan
from . import brute, exact, greedy
from .cache import PlanCache
from .conflicts import RULES, Violation, check_conflicts
from .solution import Solution, SolveStatus, check_budget, floor_plan

__all__ = ["Plan", "PlanCache", "RULES", "Solution", "SolveStatus", "Violation", "brute", "check_budget",
           "check_conflicts", "exact", "floor_plan", "greedy"]
