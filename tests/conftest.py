"""Hypothesis profiles: `default` for the suite, `stress` for long runs
(`pytest --hypothesis-profile=stress tests/engine/scheduler/test_properties.py`)."""

from hypothesis import HealthCheck, settings

_SHARED = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("default", max_examples=300, **_SHARED)
settings.register_profile("stress", max_examples=5000, **_SHARED)
settings.load_profile("default")
