"""`continuum bench calibrate`: a measured cost profile fitted to the step traces of a real run.

Each busy step of each trace (`tracing.steps`: its batch rebuilt from the events, its
duration up to the next step's snapshot) is one sample; steps after which the engine went
idle, steps whose batch is unknown and the first `--warmup-steps` steps of each trace (kernel
selection and allocator growth on the engine's first batches) are dropped. The coefficients
of `engine.executor.step_cost.StepCostModel` are fitted to the samples of the `--trace`
files by non-negative least squares (scikit-learn's `LinearRegression(positive=True)`: a
negative cost would make bigger batches cheaper). Least squares fits the mean step time, so
a simulation's busy time matches the run's, occasional slow steps included.

The fit is reported per trace (busy time measured and predicted, R^2 of the step times, mean
absolute error of a step), for the fitted traces and for the `--check` traces held out.
`--out` writes the profile (`engine.executor.measured`) on top of `--base-profile`, the
roofline profile of the model and device the traces were measured on, with the date of the
traces, the engine commit they measured and the command that fitted them.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from sklearn.linear_model import LinearRegression

from engine.executor.measured import MeasuredProfile, TraceFit, write_measured_profile
from engine.executor.roofline import DEFAULT_SIM_PROFILE, SIM_PROFILES
from engine.executor.step_cost import COST_TERMS, StepCostModel, StepCounts
from tracing.reader import Trace, TraceFormatError, read_trace
from tracing.steps import timed_steps

DEFAULT_WARMUP_STEPS = 20


@dataclass(frozen=True)
class StepSamples:
    """The usable steps of one trace: `counts` [steps, terms] (`StepCounts` per step, in
    `COST_TERMS` order) and `durations_s` [steps]; how many steps were dropped as idle (or
    last), as warm-up, and for an unknown batch."""

    trace: str
    counts: np.ndarray
    durations_s: np.ndarray
    num_idle: int
    num_warmup: int
    num_unknown: int

    @property
    def num_steps(self) -> int:
        return len(self.durations_s)


def step_samples(trace: Trace, *, warmup_steps: int = DEFAULT_WARMUP_STEPS) -> StepSamples:
    """The samples of `trace`, less its first `warmup_steps` steps, idle and unknown ones."""
    steps = timed_steps(trace)
    warm = steps[warmup_steps:]
    timed = [step for step in warm if step.duration_s is not None]
    known = [step for step in timed if step.complete]
    counts = np.array([StepCounts.of(step.batch).as_tuple() for step in known], dtype=float)
    return StepSamples(
        trace=trace.path.name, counts=counts.reshape(len(known), len(COST_TERMS)),
        durations_s=np.array([step.duration_s for step in known], dtype=float),
        num_idle=len(warm) - len(timed), num_warmup=len(steps) - len(warm),
        num_unknown=len(timed) - len(known),
    )


def fit_step_cost(samples: Sequence[StepSamples]) -> StepCostModel:
    """Non-negative least squares over the samples of every trace together; ValueError
    without any."""
    counts = np.vstack([item.counts for item in samples])
    durations_s = np.concatenate([item.durations_s for item in samples])
    if not len(durations_s):
        raise ValueError("no busy step to fit: the traces are empty, idle or all warm-up")
    regression = LinearRegression(positive=True, fit_intercept=False)
    regression.fit(counts, durations_s)
    return StepCostModel.from_coefficients(np.maximum(regression.coef_, 0.0))


def trace_fit(model: StepCostModel, samples: StepSamples, *, used_for_fit: bool) -> TraceFit:
    """How well `model` predicts the samples of one trace."""
    measured = samples.durations_s
    predicted = samples.counts @ np.array(model.coefficients())
    spread = float(np.sum((measured - measured.mean()) ** 2)) if len(measured) else 0.0
    residual = float(np.sum((measured - predicted) ** 2))
    return TraceFit(
        trace=samples.trace, used_for_fit=used_for_fit, num_steps=samples.num_steps,
        measured_s=float(measured.sum()), predicted_s=float(predicted.sum()),
        r2=1.0 - residual / spread if spread > 0 else 0.0,
        mean_abs_error_s=float(np.abs(measured - predicted).mean()) if len(measured) else 0.0,
    )


def measured_on(traces: Sequence[Trace]) -> datetime:
    """When the latest of the traces was started (UTC), from their headers."""
    return datetime.fromtimestamp(max(t.header.created_unix_s for t in traces), timezone.utc)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", nargs="+", required=True, metavar="FILE",
                        help="scheduler traces of a real run to fit on (JSONL, or .gz)")
    parser.add_argument("--check", nargs="*", default=[], metavar="FILE",
                        help="traces held out of the fit, only to report its error on")
    parser.add_argument("--base-profile", default=DEFAULT_SIM_PROFILE, choices=list(SIM_PROFILES),
                        help="the roofline profile of the model and device the traces ran "
                             "(shape, KV pool, host link) (default: %(default)s)")
    parser.add_argument("--name", required=True, help="the measured profile's name")
    parser.add_argument("--engine-commit", required=True,
                        help="the engine commit the traces measured")
    parser.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP_STEPS, metavar="N",
                        help="steps dropped at the start of each trace (default: %(default)s)")
    parser.add_argument("--out", default=None, metavar="PROFILE.json",
                        help="write the profile here (default: only print the fit)")


def command_line(args: argparse.Namespace) -> str:
    """The command that reproduces this calibration (written into the profile)."""
    words = ["continuum", "bench", "calibrate", "--trace", *args.trace]
    if args.check:
        words += ["--check", *args.check]
    words += ["--base-profile", args.base_profile, "--name", args.name,
              "--engine-commit", args.engine_commit, "--warmup-steps", str(args.warmup_steps)]
    if args.out:
        words += ["--out", args.out]
    return shlex.join(words)


def render(profile: MeasuredProfile) -> str:
    """The coefficients and the fit's quality per trace, as markdown tables."""
    lines = ["| cost term | coefficient |", "|---|---:|"]
    lines += [f"| {name} | {value:.4g} |"
              for name, value in zip(COST_TERMS, profile.step_cost.coefficients(), strict=True)]
    lines += ["", "| trace | fitted on | steps | measured busy (s) | predicted (s) | error "
                  "| R^2 | mean abs error / step (ms) |",
              "|---|---|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {fit.trace} | {'yes' if fit.used_for_fit else 'held out'} | {fit.num_steps} "
              f"| {fit.measured_s:.1f} | {fit.predicted_s:.1f} | {fit.total_error:+.1%} "
              f"| {fit.r2:.2f} | {1000 * fit.mean_abs_error_s:.1f} |" for fit in profile.fits]
    return "\n".join(lines)


def calibrate(args: argparse.Namespace) -> MeasuredProfile:
    """The profile the flags describe; ValueError if a trace cannot be read or fitted."""
    if args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    fitted = [_read(path) for path in args.trace]
    held_out = [_read(path) for path in args.check]
    fit_samples = [step_samples(t, warmup_steps=args.warmup_steps) for t in fitted]
    check_samples = [step_samples(t, warmup_steps=args.warmup_steps) for t in held_out]
    model = fit_step_cost(fit_samples)
    fits = [trace_fit(model, s, used_for_fit=True) for s in fit_samples]
    fits += [trace_fit(model, s, used_for_fit=False) for s in check_samples]
    return MeasuredProfile(
        name=args.name, base=SIM_PROFILES[args.base_profile], step_cost=model,
        measured_on=measured_on(fitted).date(), engine_commit=args.engine_commit,
        command=command_line(args), fits=tuple(fits),
    )


def _read(path: str) -> Trace:
    try:
        trace = read_trace(path)
    except (OSError, TraceFormatError) as error:
        raise ValueError(f"cannot read trace {path}: {error}") from None
    if trace.header.config.get("scheduler", {}).get("async_scheduling"):
        raise ValueError(
            f"trace {path} was recorded with async scheduling, where the time between two "
            "steps' snapshots is mostly the device time of the step before; record "
            "calibration traces with --no-async-scheduling")
    return trace


def main(args: argparse.Namespace) -> int:
    try:
        profile = calibrate(args)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{profile.name}: {profile.base.name} measured on {profile.measured_on} at "
          f"{profile.engine_commit}\n\n{render(profile)}")
    if args.out:
        write_measured_profile(profile, Path(args.out))
    return 0
