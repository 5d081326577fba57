"""Pipeline-aware activation-memory budget assignment (BaGuaLu-2 Algorithm 1) and deferred MoE planning.

Pure Python on top of the cost model: never imports torch.
"""

from bagualu2.budget.assigner import BudgetAssigner, BudgetPhase, downgrade_needed
from bagualu2.budget.deferred import downgrade_plan, plan_after_gate

__all__ = ["BudgetAssigner", "BudgetPhase", "downgrade_needed", "downgrade_plan", "plan_after_gate"]
