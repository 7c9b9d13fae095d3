"""The victim chain: who gives way, in which order, when a request cannot get blocks.

A request short of blocks (running, for its next tokens; the waiting head, for its
admission) takes, one at a time, until its blocks fit or the chain has nothing to give:

1. the latest pin of another tenant over its share of the KV pool (`tenant_share`);
2. a client's pin it may take, nearest its deadline first (`client_pressure`);
3. the policy's answer (`SchedulingPolicy.select_victim`): a pin of its own (`pressure`),
   or, for a running request, a running request to preempt (`out_of_blocks`), which the
   latest request of a tenant over its share replaces (`tenant_share`).

A waiting head whose reserved room is short takes the policy's pins only (the pins of steps
1 and 2 already counted as its room), and a waiting head of a tenant within its share may
preempt the latest request of the tenant furthest over its own (`share`, `tenant_share`).
Owned by `Scheduler`, which carries out each answer; every answer names its reason, which
the trace records (`PinReleased.reason`, `Preemption.reason`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from engine.kv_cache.pins import Pin, PinReleaseReason
from engine.request import Request, RequestStatus
from engine.scheduler.admission import Admission
from engine.scheduler.events import PreemptionReason
from engine.scheduler.policy import SchedulingPolicy
from engine.scheduler.step_plan import StepPlan

# What the requester is short of: blocks for its tokens (the whole chain), the room its
# policy reserves beyond them (the policy's pins), or its tenant's share (the share step).
Shortage = Literal["blocks", "reserved_room", "share"]


@dataclass(frozen=True, slots=True)
class ReleasePin:
    """Release `pin` (live) for the requester, for `reason`."""

    pin: Pin
    reason: PinReleaseReason


@dataclass(frozen=True, slots=True)
class Preempt:
    """Preempt running `request` (maybe the requester itself), for `reason`."""

    request: Request
    reason: PreemptionReason


GiveWay = ReleasePin | Preempt


class VictimChain:
    """Reads tenants' shares and clients' pins (`Admission`) and asks the policy; decides,
    changes nothing."""

    def __init__(self, admission: Admission, policy: SchedulingPolicy) -> None:
        self._admission = admission
        self._policy = policy

    def next(self, requester: Request, num_new_tokens: int, plan: StepPlan, now_s: float,
             shortage: Shortage = "blocks") -> GiveWay | None:
        """What gives way next for `requester`, short of `shortage` for `num_new_tokens`
        more tokens this step; None: nothing does (a running requester waits this step,
        keeping its blocks; a waiting one stays waiting)."""
        if shortage == "share":
            victim = self._admission.share_victim(requester, plan)
            return None if victim is None else Preempt(victim, "tenant_share")
        if shortage == "blocks":
            tenants_pin = self._tenants_pin(requester, num_new_tokens, plan)
            if tenants_pin is not None:
                return tenants_pin
        return self._policys_victim(requester, num_new_tokens, plan, now_s)

    def _tenants_pin(self, requester: Request, num_new_tokens: int,
                     plan: StepPlan) -> ReleasePin | None:
        pin = self._admission.over_share_pin(requester, plan)
        if pin is not None:
            return ReleasePin(pin, PinReleaseReason.TENANT_SHARE)
        pin = self._admission.client_pin_for(requester, num_new_tokens, plan)
        return None if pin is None else ReleasePin(pin, PinReleaseReason.CLIENT_PRESSURE)

    def _policys_victim(self, requester: Request, num_new_tokens: int, plan: StepPlan,
                        now_s: float) -> GiveWay | None:
        victim = self._policy.select_victim(requester, now_s)
        if victim is None:
            return None
        if isinstance(victim, Pin):
            return ReleasePin(victim, PinReleaseReason.PRESSURE)
        if requester.status is not RequestStatus.RUNNING:
            raise RuntimeError(f"policy chose {victim} as a victim for waiting "
                               f"{requester.request_id!r}: only pins give way to a waiting one")
        if victim.status is not RequestStatus.RUNNING:
            raise RuntimeError(f"policy chose {victim} as a victim, which is not running")
        replaced = self._admission.victim_instead_of(victim, requester, num_new_tokens, plan)
        return Preempt(replaced, "out_of_blocks" if replaced is victim else "tenant_share")
