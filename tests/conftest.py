"""Suite-wide settings: one torch thread per process, Triton's interpreter where there is no
GPU, and the Hypothesis profiles `default` for the suite and `stress` for long runs
(`pytest --hypothesis-profile=stress tests/engine/scheduler/test_properties.py`)."""

import os

# Tests run engine-core processes beside pytest itself on a small machine: one torch thread
# each avoids oversubscribing the cores (set before anything imports torch; inherited by the
# processes the tests spawn). A value the caller set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

# Without a GPU the Triton kernels run on CPU tensors in Triton's interpreter, which reads
# this variable when a kernel is defined: set before any kernel module is imported (and
# inherited by the servers the tests spawn).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import HealthCheck, settings

_SHARED = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("default", max_examples=300, **_SHARED)
settings.register_profile("stress", max_examples=5000, **_SHARED)
settings.load_profile("default")
