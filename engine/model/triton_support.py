"""Where Triton kernels can run, for every user of them (the attention backend, the layers'
fused kernels): CUDA with Triton installed, or CPU under Triton's interpreter
(`TRITON_INTERPRET=1`, for tests)."""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def check_triton_runs_on(device: torch.device, what: str) -> None:
    """ValueError naming `what` when Triton kernels cannot run on `device`."""
    if not triton_installed():
        raise ValueError(f"{what} needs Triton installed")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"{what} runs on CPU only under Triton's interpreter: set "
                         "TRITON_INTERPRET=1 (slow; for tests)")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} cannot run on {device}")
