"""The real model of the catalogue in tests: its checkout, or a skip (a failure under CI)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.model.catalog import SMOLLM2_135M_INSTRUCT, cached_checkout

REAL_MODEL = SMOLLM2_135M_INSTRUCT.name


def require_real_model() -> Path:
    """The checkout of `smollm2-135m-instruct`. Without it in the model cache the calling test
    skips, except under `CI=true`, where it fails: CI's set-up (`scripts/setup.sh`) fetches the
    model, so a missing one there is a broken set-up, not an optional test."""
    try:
        return cached_checkout(REAL_MODEL)
    except ValueError as missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI's set-up must fetch the real model: {missing}")
        pytest.skip(str(missing))
