"""`python -m lab check-calibration`: a cost profile's simulation of the GPU runs it was
calibrated on, against what those runs measured.

The runs are one set of agent replays in the repository (`--runs`):
`eval/gpu_runs/h100-af226d3`, `h100-24b013d` or `h100-d8b9e2f`, each an engine commit
measured on an H100 (their READMEs say how they ran). The package does not ship them: the
command reads them from a checkout (this module's own, else the working directory's), or
from `--runs-dir`. Or the runs are those a manifest names (`--manifest FILE`, a run set as
JSON beside its runs' files, `GpuRunSet.from_manifest`): `eval/gpu/paper_setups.py` writes
one for the held-out runs of the paper's comparison. Each run is simulated with the same
jobs, arrivals and engine limits as `bench agent` and `continuum serve` had (the setup's
`bench agent` flags, parsed as `bench agent` parses them), under the policy spec given for
its measured policy (`--policy LABEL=SPEC`; by default the spec that behaves as the policy
did at the set's commit).

Compared on the same definitions for both sides:
- a finished run: its mean JCT, measured by the client (`bench agent --json`); the target
  is a simulated mean within `JCT_TOLERANCE` of it;
- a run stopped early, or one with a cut (`GpuRun.cut_s`, swe40's 222 s): what it had
  finished by then (`tracing.progress`; a stopped run's cut is where its trace ends),
  measured from its trace and from the simulation's trace; the target is the same order of
  the setup's runs by jobs finished.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from itertools import combinations
from pathlib import Path

from engine.executor.sim_profiles import get_sim_profile
from eval.arrivals import arrivals_s
from eval.policy_specs import PolicySpec, policy_specs
from eval.simulator import SimSettings, Simulation
from eval.workload_flags import add_workload_arguments, load_workload
from tracing.progress import Progress, progress_by, trace_span_s
from tracing.reader import read_trace

# Where `eval/gpu_runs/` is when this module runs from a checkout of the repository.
CHECKOUT_GPU_RUNS = Path(__file__).resolve().parents[2] / "eval" / "gpu_runs"
JCT_TOLERANCE = 0.15

@dataclass(frozen=True)
class GpuSetup:
    """The workload and engine limits of a set of GPU runs, as `bench agent` and `continuum
    serve` were given them: `num_jobs` of the shipped `workload` drawn with seed 0, each cut
    to `max_turns`, token counts scaled by `token_scale`."""

    name: str
    num_jobs: int
    jobs_per_s: float
    max_turns: int
    num_kv_blocks: int
    max_num_batched_tokens: int = 2048
    workload: str = "swe"
    token_scale: float = 1.0

    def agent_flags(self) -> list[str]:
        flags = ["--workload", self.workload, "--max-turns", str(self.max_turns),
                 "--num-jobs", str(self.num_jobs), "--seed", "0"]
        if self.token_scale != 1.0:
            flags += ["--token-scale", repr(self.token_scale)]
        return flags


@dataclass(frozen=True)
class GpuRun:
    """One measured run: its setup, the label of its policy, its trace, the `bench agent
    --json` of a run that finished (None: it was stopped early, where its trace ends), and
    for a finished run the seconds by which its jobs finished are also compared (None: not)."""

    setup: GpuSetup
    policy: str
    trace_file: str
    agent_file: str | None = None
    cut_s: float | None = None


SWE24 = GpuSetup("swe24", num_jobs=24, jobs_per_s=2.0, max_turns=6, num_kv_blocks=1500)
SWE40 = GpuSetup("swe40", num_jobs=40, jobs_per_s=4.0, max_turns=8, num_kv_blocks=2500)
SWE40_CUT_S = 222.0


def _stem(setup: GpuSetup, policy: str) -> str:
    """A run's file name without suffix, e.g. `swe24-2jps-1500blk-fcfs`."""
    return f"{setup.name}-{setup.jobs_per_s:g}jps-{setup.num_kv_blocks}blk-{policy}"


def _finished(setup: GpuSetup, policy: str, cut_s: float | None = None) -> GpuRun:
    stem = _stem(setup, policy)
    return GpuRun(setup, policy, f"{stem}.jsonl.gz", f"{stem}.agent.json", cut_s)


def _stopped(setup: GpuSetup, policy: str) -> GpuRun:
    return GpuRun(setup, policy, f"{_stem(setup, policy)}-cut.jsonl.gz")


def gpu_runs_root(checkout_runs: Path = CHECKOUT_GPU_RUNS, cwd: Path | None = None) -> Path:
    """The repository's `eval/gpu_runs/`: `checkout_runs` (this module's checkout), else the
    one under `cwd` (the working directory). ValueError when neither exists, as from an
    installed package, which carries no measured runs."""
    in_cwd = (Path.cwd() if cwd is None else cwd) / "eval" / "gpu_runs"
    for root in (checkout_runs, in_cwd):
        if root.is_dir():
            return root
    raise ValueError(f"the measured GPU runs are in the repository's eval/gpu_runs/, which the "
                     f"installed package does not include (looked in {checkout_runs} and "
                     f"{in_cwd}): run this from a checkout of the repository, or give "
                     f"--runs-dir")


@dataclass(frozen=True)
class GpuRunSet:
    """The runs of one engine commit on one device, in `eval/gpu_runs/NAME`, the policy specs
    that behave as that commit's policies did, and the name of the profile fitted on them
    (its file `NAME.json` beside the runs, else a profile the engine ships)."""

    name: str
    runs: tuple[GpuRun, ...]
    measured_specs: dict[str, str]
    profile: str

    @property
    def runs_dir(self) -> Path:
        """The set's folder in the repository (`gpu_runs_root`'s ValueError without one)."""
        return gpu_runs_root() / self.name

    @classmethod
    def from_manifest(cls, path: Path) -> GpuRunSet:
        """The run set a manifest file describes, its runs' files named relative to the file's
        folder: `{"name", "profile", "measured_specs": {LABEL: SPEC}, "runs": [{"setup":
        {GpuSetup's fields}, "policy", "trace_file", "agent_file", "cut_s"}]}` (`agent_file`
        and `cut_s` may be null). ValueError naming the file and what is wrong with it."""
        try:
            document = json.loads(path.read_text())
            runs = tuple(
                GpuRun(GpuSetup(**run["setup"]), str(run["policy"]), str(run["trace_file"]),
                       run.get("agent_file"), run.get("cut_s"))
                for run in document["runs"])
            run_set = cls(str(document["name"]), runs, dict(document["measured_specs"]),
                          str(document["profile"]))
        except (OSError, ValueError, KeyError, TypeError) as error:
            reason = f"missing field {error}" if isinstance(error, KeyError) else str(error)
            raise ValueError(f"manifest {path}: {reason}") from None
        if not runs:
            raise ValueError(f"manifest {path} names no run")
        missing = sorted({run.policy for run in runs} - set(run_set.measured_specs))
        if missing:
            raise ValueError(f"manifest {path}: no measured spec for {', '.join(missing)}")
        return run_set


def profile_in(runs_dir: Path, profile: str) -> str:
    """`profile` as `get_sim_profile` takes it: the file `runs_dir/PROFILE.json` when there
    is one (a profile fitted on those runs), else `profile` itself (a name or a file)."""
    beside_runs = runs_dir / f"{profile}.json"
    return str(beside_runs) if Path(profile).name == profile and beside_runs.is_file() else profile


# Continuum as the 24b013d and d8b9e2f runs measured it (`eval.policy_variants`).
CONTINUUM_AS_THE_REPLAYS_RAN = "continuum-as-replayed"


def _replays_finished_by_the_cut(commit: str, continuum_spec: str) -> GpuRunSet:
    """The H100 runs of `commit` whose fcfs and continuum replays of both setups all finished
    (swe40's by its cut), with `continuum_spec` for the continuum the commit ran and the
    profile fitted on them."""
    return GpuRunSet(
        f"h100-{commit}",
        (_finished(SWE24, "fcfs"), _finished(SWE24, "continuum"),
         _finished(SWE40, "fcfs", SWE40_CUT_S), _finished(SWE40, "continuum", SWE40_CUT_S)),
        {"fcfs": "fcfs", "continuum": continuum_spec},
        f"h100-llama3.1-8b-{commit}")


RUN_SETS = {
    run_set.name: run_set for run_set in (
        GpuRunSet(
            "h100-af226d3",
            (_finished(SWE24, "fcfs"), _finished(SWE24, "continuum"),
             _stopped(SWE24, "continuum-fixed"), _stopped(SWE40, "fcfs"),
             _stopped(SWE40, "continuum")),
            {"fcfs": "fcfs", "continuum": "continuum-af226d3",
             "continuum-fixed": "continuum-af226d3:estimator=fixed-2s"},
            "h100-llama3.1-8b-measured"),
        _replays_finished_by_the_cut("24b013d", CONTINUUM_AS_THE_REPLAYS_RAN),
        _replays_finished_by_the_cut("d8b9e2f", CONTINUUM_AS_THE_REPLAYS_RAN),
    )
}
DEFAULT_RUN_SET = "h100-af226d3"


@dataclass(frozen=True)
class RunCheck:
    """One run measured and simulated: the mean JCT of a finished run, the progress of a
    stopped one (the other None), and the policy spec simulated."""

    setup: str
    policy: str
    spec: str
    measured_jct_s: float | None = None
    simulated_jct_s: float | None = None
    measured: Progress | None = None
    simulated: Progress | None = None

    @property
    def jct_error(self) -> float | None:
        if self.measured_jct_s is None or self.simulated_jct_s is None:
            return None
        return self.simulated_jct_s / self.measured_jct_s - 1.0


@dataclass(frozen=True)
class OrderCheck:
    """Two stopped runs of one setup ordered by jobs finished, measured and simulated (+1:
    the first finished more, -1: fewer, 0: as many)."""

    setup: str
    first: str
    second: str
    measured: int
    simulated: int

    @property
    def met(self) -> bool:
        return self.measured == self.simulated


def check_run(run: GpuRun, spec: PolicySpec, profile: str, runs_dir: Path,
              work_dir: Path) -> RunCheck:
    """Simulates `run` under `spec` with `profile`, and reads what it measured."""
    setup = run.setup
    parser = argparse.ArgumentParser()
    add_workload_arguments(parser)
    jobs = load_workload(parser.parse_args(setup.agent_flags()))
    sim_trace = work_dir / f"{setup.name}-{run.policy}.jsonl"
    settings = SimSettings(
        policy=spec.policy, policy_options=spec.options, profile=profile,
        num_kv_blocks=setup.num_kv_blocks, max_num_batched_tokens=setup.max_num_batched_tokens,
        trace_path=str(sim_trace))
    metrics = Simulation(jobs, arrivals_s(len(jobs), setup.jobs_per_s, seed=0), settings).run()
    check = RunCheck(setup.name, run.policy, spec.label)
    if run.agent_file is not None:
        agent = json.loads((runs_dir / run.agent_file).read_text())
        check = replace(check, measured_jct_s=agent["runs"][0]["mean_jct_s"],
                        simulated_jct_s=metrics.mean_jct_s)
        if run.cut_s is None:
            return check
    measured_trace = read_trace(runs_dir / run.trace_file)
    cut_s = trace_span_s(measured_trace) if run.cut_s is None else run.cut_s
    return replace(check, measured=progress_by(measured_trace, cut_s),
                   simulated=progress_by(read_trace(sim_trace), cut_s))


def order_checks(checks: Sequence[RunCheck]) -> list[OrderCheck]:
    """Each pair of runs of one setup compared at a cut, ordered by jobs finished on both
    sides."""
    stopped = [(c, c.measured, c.simulated) for c in checks
               if c.measured is not None and c.simulated is not None]
    return [
        OrderCheck(a.setup, a.policy, b.policy,
                   _sign(a_measured.jobs_finished - b_measured.jobs_finished),
                   _sign(a_simulated.jobs_finished - b_simulated.jobs_finished))
        for (a, a_measured, a_simulated), (b, b_measured, b_simulated)
        in combinations(stopped, 2) if a.setup == b.setup
    ]


def _sign(value: int) -> int:
    return (value > 0) - (value < 0)


def render(checks: Sequence[RunCheck], orders: Sequence[OrderCheck]) -> str:
    """Markdown tables: mean JCTs, the stopped runs' progress, and the orders."""
    lines = ["| setup | policy (spec simulated) | measured mean JCT (s) | simulated (s) | error "
             f"| within {JCT_TOLERANCE:.0%} |", "|---|---|---:|---:|---:|---|"]
    for c in checks:
        if c.jct_error is not None:
            lines.append(f"| {c.setup} | {c.policy} ({c.spec}) | {c.measured_jct_s:.1f} "
                         f"| {c.simulated_jct_s:.1f} | {c.jct_error:+.1%} "
                         f"| {'met' if abs(c.jct_error) <= JCT_TOLERANCE else 'missed'} |")
    lines += ["", "| setup | policy (spec simulated) | cut at (s) | jobs finished "
              "(measured / simulated) | last turns sent | turns finished |",
              "|---|---|---:|---:|---:|---:|"]
    for c in checks:
        if c.measured is not None and c.simulated is not None:
            m, s = c.measured, c.simulated
            lines.append(f"| {c.setup} | {c.policy} ({c.spec}) | {m.by_s:.1f} "
                         f"| {m.jobs_finished} / {s.jobs_finished} "
                         f"| {m.last_turns_arrived} / {s.last_turns_arrived} "
                         f"| {m.turns_finished} / {s.turns_finished} |")
    symbols = {1: ">", 0: "=", -1: "<"}
    lines += ["", "| setup | jobs finished, measured | simulated | order |", "|---|---|---|---|"]
    lines += [f"| {o.setup} | {o.first} {symbols[o.measured]} {o.second} "
              f"| {o.first} {symbols[o.simulated]} {o.second} "
              f"| {'met' if o.met else 'missed'} |" for o in orders]
    return "\n".join(lines)


def _policy_map(run_set: GpuRunSet, items: Sequence[str]) -> dict[str, PolicySpec]:
    """`LABEL=SPEC` items: the spec simulated for the measured policy LABEL (by default the
    set's `measured_specs`: the policy as it was measured). ValueError for a malformed item,
    an unknown label or a bad spec."""
    labels = {run.policy for run in run_set.runs}
    specs = {label: run_set.measured_specs[label] for label in labels}
    for item in items:
        label, sep, spec = item.partition("=")
        if not sep or label not in labels:
            raise ValueError(f"--policy {item!r}: expected LABEL=SPEC with LABEL one of "
                             f"{', '.join(sorted(labels))}")
        specs[label] = spec
    return {label: policy_specs(spec)[0] for label, spec in specs.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    runs = parser.add_mutually_exclusive_group()
    runs.add_argument("--runs", choices=sorted(RUN_SETS), default=None,
                      help="the GPU runs to check against, in the repository's "
                           f"eval/gpu_runs/ (default: {DEFAULT_RUN_SET})")
    runs.add_argument("--manifest", type=Path, default=None, metavar="FILE",
                      help="the GPU runs a manifest names (JSON beside their files, as "
                           "eval/gpu/paper_setups.py writes it)")
    parser.add_argument("--profile", default=None, metavar="NAME|FILE",
                        help="the cost profile to check (default: the one fitted on --runs: "
                             + ", ".join(f"{s.profile} for {s.name}" for s in RUN_SETS.values())
                             + ")")
    parser.add_argument("--policy", action="append", default=[], metavar="LABEL=SPEC",
                        help="simulate the measured policy LABEL (fcfs, continuum, "
                             "continuum-fixed) as the policy spec SPEC (default: the spec that "
                             "behaves as measured: continuum-af226d3 for continuum at "
                             "af226d3)")
    parser.add_argument("--runs-dir", type=Path, default=None,
                        help="where the measured traces and agent JSONs are "
                             "(default: eval/gpu_runs/RUNS of the repository checkout, or the "
                             "manifest's folder)")
    parser.add_argument("--json", default=None, help="write the figures here")


def main(args: argparse.Namespace) -> int:
    try:
        if args.manifest is not None:
            run_set = GpuRunSet.from_manifest(args.manifest)
            runs_dir = args.runs_dir or args.manifest.parent
        else:
            run_set = RUN_SETS[args.runs or DEFAULT_RUN_SET]
            runs_dir = args.runs_dir or run_set.runs_dir
        profile = profile_in(runs_dir, args.profile or run_set.profile)
        specs = _policy_map(run_set, args.policy)
        get_sim_profile(profile)
        with tempfile.TemporaryDirectory() as work_dir:
            checks = [check_run(run, specs[run.policy], profile, runs_dir, Path(work_dir))
                      for run in run_set.runs]
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    orders = order_checks(checks)
    print(f"{profile} against the runs in {runs_dir}\n\n{render(checks, orders)}")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"run_set": run_set.name, "profile": profile, "runs": [asdict(c) for c in checks],
             "orders": [asdict(o) for o in orders]}, indent=1) + "\n")
    return 0
