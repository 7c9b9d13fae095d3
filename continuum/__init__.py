"""The agent scheduling policies: Continuum and the baselines it is compared with, each an
`AgentPolicy` composed of strategies (see docs/architecture.md, 'Scheduling policies').

Registered in the engine's policy registry as `continuum`, `continuum-fixed`, `job-fcfs`,
`infercept` and `autellix` (`continuum.presets`).
"""

from continuum.agent_policy import AgentPolicy, Strategies
from continuum.policy_options import (
    ContinuumOptions,
    InferCeptOptions,
    JobOptions,
    ProgramOrderOptions,
)
from continuum.presets import (
    AUTELLIX,
    CONTINUUM,
    CONTINUUM_FIXED,
    INFERCEPT,
    JOB_FCFS,
    PolicyPreset,
)

__all__ = [
    "AUTELLIX",
    "CONTINUUM",
    "CONTINUUM_FIXED",
    "INFERCEPT",
    "JOB_FCFS",
    "AgentPolicy",
    "ContinuumOptions",
    "InferCeptOptions",
    "JobOptions",
    "PolicyPreset",
    "ProgramOrderOptions",
    "Strategies",
]
