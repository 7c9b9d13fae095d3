"""The Continuum scheduling policy and agent baselines (see DESIGN.md section 6)."""
