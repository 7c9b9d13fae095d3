"""A cost profile measured on a real device: step times from a fitted `StepCostModel`.

What the step-cost fit cannot know (the model's shape, the device's memory, hence the KV
pool, and its host link) comes from the roofline profile the run was measured against,
`base`. A measured profile is a JSON file, written by `continuum bench calibrate` and never
edited by hand: when the engine gets faster, calibration is rerun.

File layout (times in seconds):

    {"format": "continuum-measured-profile", "version": 1,
     "name": "...", "base_profile": "<a roofline profile name>",
     "measured_on": "YYYY-MM-DD", "engine_commit": "...", "command": "continuum bench ...",
     "step_cost": {"step_overhead_s": ..., ...every StepCostModel field...},
     "fits": [{"trace": "...", "used_for_fit": true, "num_steps": ..., "measured_s": ...,
               "predicted_s": ..., "r2": ..., "mean_abs_error_s": ...}, ...]}
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields
from datetime import date
from pathlib import Path
from typing import Any

from engine.executor.roofline import SIM_PROFILES, ModelShape, SimProfile
from engine.executor.step_cost import StepCostModel

PROFILE_FORMAT = "continuum-measured-profile"
PROFILE_VERSION = 1


@dataclass(frozen=True)
class TraceFit:
    """How well a step-cost model predicts the busy steps of one trace: `num_steps` samples,
    their summed `measured_s` and `predicted_s`, R^2 over the steps, and the mean absolute
    error of one step. `used_for_fit`: the trace was fitted on (else held out)."""

    trace: str
    used_for_fit: bool
    num_steps: int
    measured_s: float
    predicted_s: float
    r2: float
    mean_abs_error_s: float

    @property
    def total_error(self) -> float:
        """The predicted busy time's relative error (+: predicted slower than measured)."""
        return self.predicted_s / self.measured_s - 1.0


@dataclass(frozen=True)
class MeasuredProfile:
    """A profile for the simulated executor whose step times were measured: `step_cost` on
    top of the roofline profile `base` (model shape, KV pool, host link). `measured_on` is
    the date of the traces, `engine_commit` the engine they measured, `command` what fitted
    them, `fits` the fit's quality per trace."""

    name: str
    base: SimProfile
    step_cost: StepCostModel
    measured_on: date
    engine_commit: str
    command: str
    fits: tuple[TraceFit, ...] = ()

    def __post_init__(self) -> None:
        for name in ("name", "engine_commit", "command"):
            if not getattr(self, name):
                raise ValueError(f"measured profile: {name} is empty")

    @property
    def model(self) -> ModelShape:
        return self.base.model

    @property
    def num_kv_tokens(self) -> int:
        """Tokens of KV the base profile's device memory holds."""
        return self.base.num_kv_tokens

    @property
    def host_memory_bytes(self) -> float:
        return self.base.host_memory_bytes

    def step_time_s(self, batch: Iterable[tuple[int, int]]) -> float:
        """Seconds of one step over `(num_computed_tokens, num_new_tokens)` per scheduled
        request, as measured; an empty step costs nothing."""
        return self.step_cost.step_time_s(batch)

    def prefill_time_s(self, num_tokens: int) -> float:
        """Seconds to prefill one prompt of `num_tokens` from scratch, alone in a step."""
        return self.step_time_s([(0, num_tokens)])

    def kv_copy_time_s(self, num_tokens: int) -> float:
        """Seconds to copy the KV of `num_tokens` tokens one way over the base's host link."""
        return self.base.kv_copy_time_s(num_tokens)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT, "version": PROFILE_VERSION, "name": self.name,
            "base_profile": self.base.name, "measured_on": self.measured_on.isoformat(),
            "engine_commit": self.engine_commit, "command": self.command,
            "step_cost": asdict(self.step_cost),
            "fits": [asdict(fit) for fit in self.fits],
        }


def write_measured_profile(profile: MeasuredProfile, path: str | os.PathLike[str]) -> None:
    Path(path).write_text(json.dumps(profile.to_json(), indent=1) + "\n")


def read_measured_profile(path: str | os.PathLike[str]) -> MeasuredProfile:
    """The profile in `path`; ValueError naming the file and what is wrong with it."""
    try:
        document = json.loads(Path(path).read_text())
        return _parse(document)
    except (OSError, json.JSONDecodeError, ValueError, TypeError, KeyError) as error:
        reason = f"missing field {error}" if isinstance(error, KeyError) else str(error)
        raise ValueError(f"{path} is not a measured cost profile: {reason}") from None


def _parse(document: object) -> MeasuredProfile:
    if not isinstance(document, dict) or document.get("format") != PROFILE_FORMAT:
        raise ValueError(f"its 'format' is not {PROFILE_FORMAT!r}")
    if document.get("version") != PROFILE_VERSION:
        raise ValueError(f"version {document.get('version')!r}; this engine reads "
                         f"version {PROFILE_VERSION}")
    base_name = document["base_profile"]
    if base_name not in SIM_PROFILES:
        raise ValueError(f"unknown base profile {base_name!r}; known: "
                         f"{', '.join(SIM_PROFILES)}")
    return MeasuredProfile(
        name=_text(document, "name"), base=SIM_PROFILES[base_name],
        step_cost=StepCostModel(**_numbers(document["step_cost"], StepCostModel)),
        measured_on=date.fromisoformat(_text(document, "measured_on")),
        engine_commit=_text(document, "engine_commit"), command=_text(document, "command"),
        fits=tuple(_fit(item) for item in document.get("fits", [])),
    )


def _text(document: Mapping[str, object], key: str) -> str:
    value = document[key]
    if not isinstance(value, str):
        raise ValueError(f"{key!r} must be a string, got {value!r}")
    return value


def _numbers(section: object, kind: type) -> dict[str, float]:
    """The numeric fields of dataclass `kind` from `section`, all of them required."""
    names = [item.name for item in fields(kind)]
    if not isinstance(section, dict) or set(section) != set(names):
        raise ValueError(f"{kind.__name__} needs exactly the fields {', '.join(names)}")
    return {name: _number(name, section[name]) for name in names}


def _number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _fit(item: object) -> TraceFit:
    if not isinstance(item, dict):
        raise ValueError(f"a fit must be an object, got {item!r}")
    return TraceFit(
        trace=_text(item, "trace"), used_for_fit=bool(item["used_for_fit"]),
        num_steps=int(item["num_steps"]),
        **{name: _number(name, item[name])
           for name in ("measured_s", "predicted_s", "r2", "mean_abs_error_s")},
    )
