"""The result of the scheduler's between-steps sweep (`Scheduler.sweep`)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv_cache.pins import Pin


@dataclass(frozen=True, slots=True)
class Sweep:
    """What one between-steps sweep did: the pins the policy released (with their
    `release_reason`, EXPIRED for a TTL that ran out) and the jobs it forgot after their idle
    timeout (then the inferred jobs it ended, their latest turn too old to be continued), in
    the order it did so. False when it did nothing.

    Returned by `Scheduler.sweep` to the engine core, which hands it on to its caller."""

    released_pins: tuple[Pin, ...] = ()
    forgotten_job_ids: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.released_pins or self.forgotten_job_ids)
