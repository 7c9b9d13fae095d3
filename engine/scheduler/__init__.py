"""The scheduler (torch-free): V1 semantics, with decisions delegated to policy objects."""

from engine.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.scheduler.policies import FCFSPolicy, PriorityPolicy
from engine.scheduler.policy import (
    BasePolicy,
    PolicyEnvironment,
    Reservation,
    SchedulerView,
    SchedulingPolicy,
    Victim,
)
from engine.scheduler.policy_registry import POLICIES, make_policy, resolve_policy
from engine.scheduler.request_queue import FCFSRequestQueue, KeyedRequestQueue, RequestQueue
from engine.scheduler.retention import Retention
from engine.scheduler.scheduler import Scheduler

__all__ = [
    "POLICIES",
    "BasePolicy",
    "CachedRequestData",
    "FCFSPolicy",
    "FCFSRequestQueue",
    "KeyedRequestQueue",
    "NewRequestData",
    "PolicyEnvironment",
    "PriorityPolicy",
    "RequestQueue",
    "Reservation",
    "Retention",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerView",
    "SchedulingPolicy",
    "Victim",
    "make_policy",
    "resolve_policy",
]
