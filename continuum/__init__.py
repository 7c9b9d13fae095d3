"""The Continuum scheduling policy and agent baselines (see DESIGN.md section 6).

Registered in the engine's policy registry as `continuum`, `continuum-fixed`, `infercept`
and `autellix`.
"""

from continuum.baselines import AutellixPolicy, InferCeptPolicy
from continuum.job_aware import JobAwarePolicy
from continuum.policy import ContinuumFixedPolicy, ContinuumPolicy

__all__ = [
    "AutellixPolicy",
    "ContinuumFixedPolicy",
    "ContinuumPolicy",
    "InferCeptPolicy",
    "JobAwarePolicy",
]
