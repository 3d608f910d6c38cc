"""Mixed precision: candidates, per-unit sensitivity, the measurement file, the exact planner under a bit
budget, the plan file, and turning a plan into a scheme per linear."""
