"""Deciding what to rewrite on a compact model of the step: checkpoint policies, the plan
estimate, budgets, and the planners beside them (the exact one an optional extra)."""

__all__ = ["as_run", "budget", "checkpoints", "context", "estimate", "exact", "peak",
           "plan_nodes", "search"]
