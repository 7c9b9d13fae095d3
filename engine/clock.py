"""The clock type injected into the engine core, scheduler, policies and estimator.

A clock is any zero-argument callable returning seconds on a monotonic scale:
`time.monotonic` in production, a virtual clock in simulation, a fake clock in tests.
"""

from __future__ import annotations

from collections.abc import Callable

Clock = Callable[[], float]
