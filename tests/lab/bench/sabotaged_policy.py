"""A scheduling policy that breaks a scheduler invariant on purpose, for the test that the
soak run notices a violation. Loaded by the engine core as
`--scheduling-policy tests.lab.bench.sabotaged_policy:SabotagedPolicy`."""

from __future__ import annotations

from engine.request import Request
from engine.scheduler.policies import FCFSPolicy

SABOTAGE_AFTER_FINISHED = 10


class SabotagedPolicy(FCFSPolicy):
    """FCFS until `SABOTAGE_AFTER_FINISHED` requests finished; at the next finish while
    another request runs, that request is entered in the running list twice."""

    def __init__(self) -> None:
        self.num_finished = 0

    def retention(self, request: Request, now_s: float) -> None:
        self.num_finished += 1
        running = self.scheduler.running
        if self.num_finished > SABOTAGE_AFTER_FINISHED and running:
            running.append(running[0])
