"""The paper's comparison on one GPU (`scripts/gpu_bench.sh --part paper`): which agent jobs
its replays run, on which model, at which loads, under which policies, with which flags.

Each run is one `continuum serve` (a fresh server: no prefix cache or tool-time history
carried from another run) and one `continuum bench agent` replay against it. Its name,
`paper-MODEL-WORKLOAD-Ljps-POLICY` (`paper-8b-swe-2jps-fcfs`), names its files in the
script's raw folder: `NAME.json` (the replay's report) and `NAME.trace.jsonl.gz` (the
server's scheduler trace). The models are Llama-3.1-8B in bfloat16 and Llama-3.1-70B with
FP8 projections and KV cache, random weights; the workloads the shipped SWE and BFCL jobs,
drawn with seed 0; three loads each; the policies `fcfs` (vLLM's order), `continuum-fixed`
(the release's rule) and `continuum`. A load is a setup's `L1`, `L2` or `L3` (`--loads`).

On `--device cpu` the same runs are shrunk to check the pipeline: the `tiny` model for the
8B and `eval/gpu/llama3.1-70b-shrunk.json` (FP8 projections) for the 70B, three jobs of
three turns with token counts scaled by 0.1 (enough decode steps for `bench calibrate`).

`estimate` prices each CUDA run before any device time is spent: the server's start (an
allowance per model) plus the replay, simulated (`eval.simulator`) with the cost profile
fitted on the H100 at d8b9e2f (`eval/gpu_runs/h100-d8b9e2f/`; an H200 is faster: an upper
bound for the 8B) and, for the 70B, that profile's costs scaled by its parameters' ratio at
the FP8 rate; then packs the runs, a load's three policies together, into device calls.

Usage: python eval/gpu/paper_setups.py runs --device cuda|cpu [--models 8b,70b]
           [--workloads swe,bfcl] [--loads 1,2,3]
       python eval/gpu/paper_setups.py estimate [--budget-s 540] [--models ...] [...]
       python eval/gpu/paper_setups.py manifest RUNS_DIR --device cuda|cpu --profile NAME
           --out FILE
`runs` prints a line a run, in the order they run (a setup's highest load first: the
targets are judged there), tab-separated: name, model, workload, load index, policy, config
file, the server's flags and the client's flags (each shell-quoted words). `manifest` writes
the run set that `python -m lab check-calibration --manifest` checks: the 8B runs of the
held-out load found in a folder (report and trace). Standard library only, but for
`estimate`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[2]
Device = Literal["cuda", "cpu"]
POLICIES = ("fcfs", "continuum-fixed", "continuum")
MODELS = ("8b", "70b")
WORKLOADS = ("swe", "bfcl")
NUM_LOADS = 3
# The load whose runs `bench calibrate` holds out; the others are fitted on.
HELD_OUT_LOAD = 2
MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's chunk, as every agent replay on a GPU ran
# Prompt token ids are drawn below this: any tokenizer's vocabulary holds them.
VOCAB_SIZE = 250
DEFAULT_BUDGET_S = 540  # one device call's 10 minutes, less its start and transfers


@dataclass(frozen=True)
class PaperModel:
    """A model of the comparison: its config on each device, the flags that set its
    precision there, its context limit, and an allowance for its server's start (seconds:
    weights drawn, start-up forwards, CUDA graphs, the HTTP server) in the estimate."""

    name: str
    config: dict[Device, str]  # relative to the repository's root
    flags: dict[Device, tuple[str, ...]]
    max_model_len: dict[Device, int]
    start_s: float
    # The estimate's cost scale over the 8B's H100 profile: every coefficient (the context
    # token's aside, `context_cost_scale`).
    cost_scale: float = 1.0
    context_cost_scale: float = 1.0


@dataclass(frozen=True)
class PaperSetup:
    """The jobs one model replays of one workload: `num_jobs` drawn with seed 0, each cut to
    `max_turns`, in a pool of `num_kv_blocks` (small enough that the jobs in flight compete
    for it), at each of `loads` (jobs/s), each run stopped at `stop_after_s`."""

    model: str
    workload: str
    num_jobs: int
    max_turns: int
    num_kv_blocks: int
    loads: tuple[float, float, float]
    stop_after_s: float
    token_scale: float = 1.0


@dataclass(frozen=True)
class PaperRun:
    """One server and one replay."""

    setup: PaperSetup
    load_index: int  # 1-based
    policy: str
    config: str
    serve_flags: tuple[str, ...]
    client_flags: tuple[str, ...]

    @property
    def jobs_per_s(self) -> float:
        return self.setup.loads[self.load_index - 1]

    @property
    def name(self) -> str:
        return (f"paper-{self.setup.model}-{self.setup.workload}-{self.jobs_per_s:g}jps-"
                f"{self.policy}")


PAPER_MODELS = {
    "8b": PaperModel(
        "8b", {"cuda": "engine/model/configs/llama3.1-8b.json",
               "cpu": "engine/model/tiny/config.json"},
        {"cuda": (), "cpu": ()}, {"cuda": 12288, "cpu": 2048}, start_s=25.0),
    # 70.6e9 parameters over 8.03e9 at twice the bf16 rate; a token's K and V in FP8 over 80
    # layers against bf16 over 32.
    "70b": PaperModel(
        "70b", {"cuda": "engine/model/configs/llama3.1-70b.json",
                "cpu": "eval/gpu/llama3.1-70b-shrunk.json"},
        {"cuda": ("--quantization", "fp8", "--kv-cache-dtype", "fp8"),
         # The fp8 KV cache needs the triton backend: minutes at start-up in the interpreter.
         "cpu": ("--quantization", "fp8")},
        {"cuda": 12288, "cpu": 2048}, start_s=60.0, cost_scale=4.4, context_cost_scale=1.25),
}

_CUDA_SETUPS = (
    PaperSetup("8b", "swe", num_jobs=20, max_turns=5, num_kv_blocks=1200, loads=(1, 2, 4),
               stop_after_s=120),
    PaperSetup("8b", "bfcl", num_jobs=20, max_turns=4, num_kv_blocks=1000, loads=(1, 2, 4),
               stop_after_s=120),
    PaperSetup("70b", "swe", num_jobs=12, max_turns=4, num_kv_blocks=1200,
               loads=(0.25, 0.5, 1), stop_after_s=240),
    PaperSetup("70b", "bfcl", num_jobs=12, max_turns=4, num_kv_blocks=1000,
               loads=(0.25, 0.5, 1), stop_after_s=240),
)
_CPU_SETUPS = tuple(
    PaperSetup(model, workload, num_jobs=3, max_turns=3, num_kv_blocks=256, loads=(1, 2, 4),
               stop_after_s=60, token_scale=0.1)
    for model in MODELS for workload in WORKLOADS)
SETUPS: dict[Device, tuple[PaperSetup, ...]] = {"cuda": _CUDA_SETUPS, "cpu": _CPU_SETUPS}


def paper_runs(device: Device, models: tuple[str, ...] = MODELS,
               workloads: tuple[str, ...] = WORKLOADS,
               loads: tuple[int, ...] = (1, 2, 3)) -> list[PaperRun]:
    """The runs of the chosen setups and loads, in the order they run: setup by setup, each
    setup's loads from the highest, the three policies of a load together."""
    runs = []
    for setup in SETUPS[device]:
        if setup.model not in models or setup.workload not in workloads:
            continue
        model = PAPER_MODELS[setup.model]
        for load_index in sorted(loads, reverse=True):
            for policy in POLICIES:
                serve = ("--num-kv-blocks", str(setup.num_kv_blocks),
                         "--max-model-len", str(model.max_model_len[device]),
                         "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
                         "--scheduling-policy", policy, *model.flags[device])
                client = ("--workload", setup.workload, "--max-turns", str(setup.max_turns),
                          "--num-jobs", str(setup.num_jobs),
                          "--jobs-per-s", f"{setup.loads[load_index - 1]:g}",
                          "--vocab-size", str(VOCAB_SIZE),
                          "--stop-after-s", f"{setup.stop_after_s:g}")
                if setup.token_scale != 1.0:
                    client += ("--token-scale", f"{setup.token_scale:g}")
                runs.append(PaperRun(setup, load_index, policy, model.config[device],
                                     serve, client))
    return runs


def _names(text: str, known: tuple[str, ...]) -> tuple[str, ...]:
    names = tuple(name for name in text.split(",") if name)
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(known)}"
                                         f", got {text!r}")
    return names


def _load_indices(text: str) -> tuple[int, ...]:
    return tuple(int(index) for index in _names(text, tuple(
        str(i) for i in range(1, NUM_LOADS + 1))))


def _print_runs(runs: list[PaperRun]) -> None:
    for run in runs:
        print("\t".join([run.name, run.setup.model, run.setup.workload, str(run.load_index),
                         run.policy, run.config, shlex.join(run.serve_flags),
                         shlex.join(run.client_flags)]))


def check_manifest(runs_dir: Path, device: Device, profile: str) -> dict:
    """The `python -m lab check-calibration --manifest` run set of the 8B runs of the held-out load
    whose report and trace are in `runs_dir` (files named relative to it): each run's setup
    as its server and client had it, and, for a run that did not finish every job, its cut
    (where `--stop-after-s` stopped it). Each policy is simulated as itself."""
    runs = []
    for run in paper_runs(device, models=("8b",), loads=(HELD_OUT_LOAD,)):
        report, trace = runs_dir / f"{run.name}.json", runs_dir / f"{run.name}.trace.jsonl.gz"
        if not (report.is_file() and trace.is_file()):
            continue
        measured = json.loads(report.read_text())["runs"][0]
        setup = run.setup
        finished = measured["num_finished_jobs"] == measured["num_jobs"]
        runs.append({
            "setup": {"name": f"{setup.model}-{setup.workload}-{run.jobs_per_s:g}jps",
                      "workload": setup.workload, "num_jobs": setup.num_jobs,
                      "jobs_per_s": run.jobs_per_s, "max_turns": setup.max_turns,
                      "token_scale": setup.token_scale, "num_kv_blocks": setup.num_kv_blocks,
                      "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS},
            "policy": run.policy, "trace_file": trace.name, "agent_file": report.name,
            "cut_s": None if finished else setup.stop_after_s})
    return {"name": f"paper-{runs_dir.name}", "profile": profile,
            "measured_specs": {policy: policy for policy in POLICIES}, "runs": runs}


@dataclass(frozen=True)
class RunEstimate:
    """A run's estimated seconds: its server's start and its replay, simulated."""

    run: PaperRun
    start_s: float
    replay_s: float
    finished_jobs: int

    @property
    def total_s(self) -> float:
        return self.start_s + self.replay_s


def estimate_runs(runs: list[PaperRun]) -> list[RunEstimate]:
    """Each CUDA run priced as the module's docstring says."""
    estimates = []
    for run, metrics in simulate_runs(runs):
        # The replay's clock runs from its first arrival; a few seconds to stop the server.
        replay_s = min(metrics.makespan_s, run.setup.stop_after_s) + 3.0
        estimates.append(RunEstimate(run, PAPER_MODELS[run.setup.model].start_s, replay_s,
                                     metrics.num_finished_jobs))
    return estimates


def simulate_runs(runs: list[PaperRun], trace_dir: Path | None = None) -> list[tuple[PaperRun,
                                                                                     Any]]:
    """Each run simulated (`eval.simulator`) on the estimate's cost profile of its model, with
    its jobs, arrivals, pool and policy, cut where `--stop-after-s` stops the replay: each
    run's `RunMetrics`. With `trace_dir`, each run writes its scheduler trace there as
    `NAME.trace.jsonl`."""
    from eval.arrivals import arrivals_s
    from eval.simulator import SimSettings, Simulation
    from eval.workload_flags import add_workload_arguments, load_workload

    gpu_runs = Path(__file__).resolve().parents[1] / "gpu_runs"
    base_profile = gpu_runs / "h100-d8b9e2f" / "h100-llama3.1-8b-d8b9e2f.json"
    simulated = []
    with tempfile.TemporaryDirectory() as folder:
        profiles = {name: _scaled_profile(base_profile, model, Path(folder))
                    for name, model in PAPER_MODELS.items()}
        for run in runs:
            parser = argparse.ArgumentParser()
            add_workload_arguments(parser)
            setup = run.setup
            jobs = load_workload(parser.parse_args(
                ["--workload", setup.workload, "--max-turns", str(setup.max_turns),
                 "--num-jobs", str(setup.num_jobs), "--token-scale", repr(setup.token_scale)]))
            trace = None if trace_dir is None else str(trace_dir / f"{run.name}.trace.jsonl")
            settings = SimSettings(policy=run.policy, profile=profiles[setup.model],
                                   num_kv_blocks=setup.num_kv_blocks,
                                   max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                                   trace_path=trace)
            metrics = Simulation(jobs, arrivals_s(len(jobs), run.jobs_per_s, seed=0),
                                 settings).run()
            simulated.append((run, metrics))
    return simulated


def write_stand_in(runs: list[PaperRun], out_dir: Path) -> None:
    """The dry run's stand-in for the device's files: each run simulated (`simulate_runs`),
    its report written as `bench agent --json` writes it (`NAME.json`, `base_url` naming the
    simulator) and its trace gzipped beside it (`NAME.trace.jsonl.gz`), for
    `paper_report.py`, `bench calibrate` and `check-calibration` to read as they read the
    device's."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for run, metrics in simulate_runs(runs, trace_dir=out_dir):
        report = {"base_url": "simulator", "trace": run.setup.workload,
                  "runs": [{"label": run.policy, "policy": run.policy,
                            "jobs_per_s": run.jobs_per_s, "stop_after_s": run.setup.stop_after_s,
                            **metrics.to_dict()}]}
        (out_dir / f"{run.name}.json").write_text(json.dumps(report, indent=1) + "\n")
        trace = out_dir / f"{run.name}.trace.jsonl"
        if trace.is_file():
            with trace.open("rb") as source, gzip.open(f"{trace}.gz", "wb") as target:
                shutil.copyfileobj(source, target)
            trace.unlink()


def _scaled_profile(base: Path, model: PaperModel, folder: Path) -> str:
    """The measured profile at `base` with `model`'s cost scales applied, as a file."""
    from dataclasses import replace

    from engine.executor.measured import read_measured_profile, write_measured_profile

    if model.cost_scale == 1.0 and model.context_cost_scale == 1.0:
        return str(base)
    profile = read_measured_profile(base)
    cost = profile.step_cost
    scaled = replace(cost, **{
        name: value * (model.context_cost_scale if name == "context_token_s"
                       else model.cost_scale)
        for name, value in vars(cost).items()})
    path = folder / f"estimate-{model.name}.json"
    write_measured_profile(replace(profile, name=f"estimate-{model.name}", step_cost=scaled,
                                   fits=()), path)
    return str(path)


def pack_calls(estimates: list[RunEstimate], budget_s: float) -> list[list[RunEstimate]]:
    """The runs in order, a load's policies kept together, cut into device calls of at most
    `budget_s` each (a load that alone exceeds it gets a call of its own)."""
    groups: list[list[RunEstimate]] = []
    for estimate in estimates:
        run = estimate.run
        key = (run.setup.model, run.setup.workload, run.load_index)
        if groups and groups[-1][0].run.setup.model == key[0] and (
                groups[-1][0].run.setup.workload, groups[-1][0].run.load_index) == key[1:]:
            groups[-1].append(estimate)
        else:
            groups.append([estimate])
    calls: list[list[RunEstimate]] = []
    for group in groups:
        seconds = sum(item.total_s for item in group)
        if calls and sum(item.total_s for item in calls[-1]) + seconds <= budget_s:
            calls[-1].extend(group)
        else:
            calls.append(list(group))
    return calls


def _print_estimate(estimates: list[RunEstimate], budget_s: float) -> None:
    print("| run | start (s) | replay (s) | jobs finished (simulated) |")
    print("|---|---:|---:|---:|")
    for item in estimates:
        print(f"| {item.run.name} | {item.start_s:.0f} | {item.replay_s:.0f} | "
              f"{item.finished_jobs}/{item.run.setup.num_jobs} |")
    print(f"\nDevice calls of at most {budget_s:g} s (`--budget-s`), a load's three policies "
          "together:\n")
    for number, call in enumerate(pack_calls(estimates, budget_s), 1):
        parts = dict.fromkeys(f"{item.run.setup.model} {item.run.setup.workload} "
                              f"L{item.run.load_index}" for item in call)
        print(f"- call {number}: {', '.join(parts)}: "
              f"{sum(item.total_s for item in call):.0f} s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    manifest = commands.add_parser("manifest")
    manifest.add_argument("runs_dir", type=Path)
    manifest.add_argument("--device", choices=("cuda", "cpu"), required=True)
    manifest.add_argument("--profile", required=True,
                          help="the profile the run set names (check-calibration's default)")
    manifest.add_argument("--out", type=Path, required=True)
    for name in ("runs", "estimate", "stand-in"):
        command = commands.add_parser(name)
        if name == "runs":
            command.add_argument("--device", choices=("cuda", "cpu"), required=True)
        elif name == "estimate":
            command.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S)
        else:
            command.add_argument("out_dir", type=Path)
        command.add_argument("--models", type=lambda text: _names(text, MODELS), default=MODELS)
        command.add_argument("--workloads", type=lambda text: _names(text, WORKLOADS),
                             default=WORKLOADS)
        command.add_argument("--loads", type=_load_indices, default=(1, 2, 3))
    args = parser.parse_args(argv)
    if args.command == "manifest":
        run_set = check_manifest(args.runs_dir, args.device, args.profile)
        args.out.write_text(json.dumps(run_set, indent=1) + "\n")
        print(f"{len(run_set['runs'])} held-out runs in {args.out}")
        return 0
    if args.command == "runs":
        _print_runs(paper_runs(args.device, args.models, args.workloads, args.loads))
    elif args.command == "stand-in":
        runs = paper_runs("cuda", args.models, args.workloads, args.loads)
        write_stand_in(runs, args.out_dir)
        print(f"{len(runs)} runs simulated into {args.out_dir}")
    else:
        runs = paper_runs("cuda", args.models, args.workloads, args.loads)
        _print_estimate(estimate_runs(runs), args.budget_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
