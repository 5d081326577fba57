"""Pipeline-aware activation-memory budget assignment (BaGuaLu-2 Algorithm 1) and deferred MoE planning.

Pure stdlib: never imports torch or numpy.
"""

from bagualu2.budget.assigner import BudgetAssigner, BudgetPhase, downgrade_needed

__all__ = ["BudgetAssigner", "BudgetPhase", "downgrade_needed"]
