"""Pipeline-aware activation-memory budget assignment (BaGuaLu-2 Algorithm 1); the after-gate decision lives in
``bagualu2.runtime``.

Pure Python on top of the cost model: never imports torch.
"""

from bagualu2.budget.assigner import BudgetAssigner, BudgetPhase

__all__ = ["BudgetAssigner", "BudgetPhase"]
