"""The Continuum scheduling policy and agent baselines (see docs/architecture.md, 'The policies').

Registered in the engine's policy registry as `continuum`, `continuum-fixed`,
`continuum-oracle`, `job-fcfs`, `infercept` and `autellix`.
"""

from continuum.baselines import AutellixPolicy, InferCeptPolicy
from continuum.job_aware import JobAwarePolicy
from continuum.options import ContinuumOptions, InferCeptOptions, JobOptions, ProgramOrderOptions
from continuum.oracle import ContinuumOraclePolicy
from continuum.policy import ContinuumFixedPolicy, ContinuumPolicy
from continuum.program_order import JobFCFSPolicy

__all__ = [
    "AutellixPolicy",
    "ContinuumFixedPolicy",
    "ContinuumOptions",
    "ContinuumOraclePolicy",
    "ContinuumPolicy",
    "InferCeptOptions",
    "InferCeptPolicy",
    "JobAwarePolicy",
    "JobFCFSPolicy",
    "JobOptions",
    "ProgramOrderOptions",
]
