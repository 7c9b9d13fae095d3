"""The paper's comparison as measured (`scripts/gpu_bench.sh --part paper`): its targets judged
on the replays' reports, and the figure of mean JCT against load, a line a policy.

Usage: python eval/gpu/paper_report.py DIR [DIR ...] --out OUT_DIR

Reads every `paper-MODEL-WORKLOAD-Ljps-POLICY.json` (a `continuum bench agent --json` report,
named by `eval/gpu/paper_setups.py`) in the folders, the first of a name winning, and writes
OUT_DIR/paper.md, paper.json and, where matplotlib imports, paper-jct.png. For each model and
workload, at the highest load where fcfs finished every job:

- `continuum`'s mean JCT at most 0.8 x fcfs's;
- `continuum`'s mean JCT at most 0.95 x `continuum-fixed`'s;

and at every load, against fcfs's run:

- never worse: as many jobs finished, and a mean JCT at most 1.01 x (the 1 % of noise that
  `scripts/policy_targets_report.py` allows);
- recomputed tokens (after preemptions) at most max(1.2 x fcfs's, fcfs's + 1,000), that
  script's bound.

A figure a run lacks (no such run, no job finished) leaves its target `n/a`. Standard
library only, but for the figure. Exits 0: the verdicts are the output.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

POLICIES = ("fcfs", "continuum-fixed", "continuum")
CANDIDATE = "continuum"
FCFS_FACTOR = 0.8
FIXED_FACTOR = 0.95
NOISE_FACTOR = 1.01
RECOMPUTE_FACTOR = 1.2
RECOMPUTE_SLACK_TOKENS = 1_000
_NAME = re.compile(r"paper-(?P<model>[^-]+)-(?P<workload>[^-]+)-(?P<load>[0-9.]+)jps-"
                   r"(?P<policy>[a-z-]+)\.json")


@dataclass(frozen=True)
class Verdict:
    """One target in one model and workload: met (None: a figure is missing) and why."""

    target: str
    met: bool | None
    detail: str


def read_runs(folders: list[Path]) -> dict[tuple[str, str], dict[float, dict[str, dict]]]:
    """The runs of each (model, workload), by load, then policy: each report's one run."""
    groups: dict[tuple[str, str], dict[float, dict[str, dict]]] = {}
    for folder in folders:
        for path in sorted(folder.glob("paper-*.json")):
            match = _NAME.fullmatch(path.name)
            if match is None or match["policy"] not in POLICIES:
                continue
            by_load = groups.setdefault((match["model"], match["workload"]), {})
            by_policy = by_load.setdefault(float(match["load"]), {})
            by_policy.setdefault(match["policy"], json.loads(path.read_text())["runs"][0])
    return groups


def finished_all(run: dict | None) -> bool:
    return run is not None and run["num_finished_jobs"] == run["num_jobs"]


def judged_load(by_load: dict[float, dict[str, dict]]) -> float | None:
    """The highest load at which fcfs finished every job."""
    return max((load for load, runs in by_load.items() if finished_all(runs.get("fcfs"))),
               default=None)


def judge(by_load: dict[float, dict[str, dict]]) -> list[Verdict]:
    """The targets of one model and workload."""
    load = judged_load(by_load)
    verdicts = []
    for reference, factor in (("fcfs", FCFS_FACTOR), ("continuum-fixed", FIXED_FACTOR)):
        name = f"mean JCT <= {factor:g} x {reference}'s where fcfs finishes every job"
        if load is None:
            verdicts.append(Verdict(name, None, "fcfs finished every job at no load"))
            continue
        verdicts.append(_ratio_verdict(name, by_load[load], reference, factor, load))
    for load in sorted(by_load):
        verdicts.append(_not_worse(by_load[load], load))
        verdicts.append(_recompute(by_load[load], load))
    return verdicts


def _ratio_verdict(name: str, runs: dict[str, dict], reference: str, factor: float,
                   load: float) -> Verdict:
    mine, theirs = _mean_jct(runs.get(CANDIDATE)), _mean_jct(runs.get(reference))
    if mine is None or theirs is None:
        return Verdict(name, None, f"at {load:g} jobs/s: a run or its mean JCT is missing")
    ratio = mine / theirs
    return Verdict(name, ratio <= factor, f"at {load:g} jobs/s: {mine:.1f} s against "
                                          f"{theirs:.1f} s, {ratio:.3f}x")


def _not_worse(runs: dict[str, dict], load: float) -> Verdict:
    name = f"not worse than fcfs at {load:g} jobs/s"
    mine, theirs = runs.get(CANDIDATE), runs.get("fcfs")
    if mine is None or theirs is None:
        return Verdict(name, None, "a run is missing")
    if mine["num_finished_jobs"] != theirs["num_finished_jobs"]:
        met = mine["num_finished_jobs"] > theirs["num_finished_jobs"]
        return Verdict(name, met, f"jobs finished {mine['num_finished_jobs']} against "
                                  f"{theirs['num_finished_jobs']}")
    mine_s, theirs_s = _mean_jct(mine), _mean_jct(theirs)
    if mine_s is None or theirs_s is None:
        return Verdict(name, None, "no job finished")
    ratio = mine_s / theirs_s
    return Verdict(name, ratio <= NOISE_FACTOR,
                   f"{mine_s:.1f} s against {theirs_s:.1f} s, {ratio:.3f}x (bound "
                   f"{NOISE_FACTOR:g}x)")


def _recompute(runs: dict[str, dict], load: float) -> Verdict:
    name = f"recomputed tokens within fcfs's bound at {load:g} jobs/s"
    mine = (runs.get(CANDIDATE) or {}).get("recomputed_tokens")
    theirs = (runs.get("fcfs") or {}).get("recomputed_tokens")
    if mine is None or theirs is None:
        return Verdict(name, None, "a run or its count is missing")
    bound = max(RECOMPUTE_FACTOR * theirs, theirs + RECOMPUTE_SLACK_TOKENS)
    return Verdict(name, mine <= bound, f"{mine:,} against fcfs's {theirs:,} (bound "
                                        f"{bound:,.0f})")


def _mean_jct(run: dict | None) -> float | None:
    return None if run is None else run.get("mean_jct_s")


def _cell(value: float | None, unit: str = "") -> str:
    return "-" if value is None else f"{value:.1f}{unit}"


def markdown(groups: dict[tuple[str, str], dict[float, dict[str, dict]]],
             verdicts: dict[tuple[str, str], list[Verdict]]) -> str:
    """A table of runs and the verdicts, for each model and workload."""
    lines = ["# The paper's comparison", ""]
    if not groups:
        return "\n".join([*lines, "No paper run reported.", ""])
    for (model, workload), by_load in sorted(groups.items()):
        lines += [f"## {model}, {workload}", "",
                  "| jobs/s | policy | jobs finished | mean / p90 JCT (s) | vs fcfs (mean) | "
                  "cached tokens | preemptions | recomputed tokens |",
                  "|---:|---|---:|---|---:|---:|---:|---:|"]
        for load in sorted(by_load):
            fcfs_s = _mean_jct(by_load[load].get("fcfs"))
            for policy in POLICIES:
                run = by_load[load].get(policy)
                if run is None:
                    continue
                mean_s = _mean_jct(run)
                speedup = "-" if not mean_s or not fcfs_s else f"{fcfs_s / mean_s:.2f}x"
                lines.append(
                    f"| {load:g} | {policy} | {run['num_finished_jobs']}/{run['num_jobs']} | "
                    f"{_cell(mean_s)} / {_cell(run.get('p90_jct_s'))} | {speedup} | "
                    f"{run['cached_token_fraction']:.1%} | {run.get('preemptions', '-')} | "
                    f"{run.get('recomputed_tokens', '-')} |")
        lines += ["", "| target | verdict | figures |", "|---|---|---|"]
        for verdict in verdicts[(model, workload)]:
            shown = {True: "met", False: "MISSED", None: "n/a"}[verdict.met]
            lines.append(f"| {verdict.target} | {shown} | {verdict.detail} |")
        lines.append("")
    return "\n".join(lines)


def plot(groups: dict[tuple[str, str], dict[float, dict[str, dict]]], path: Path) -> bool:
    """Mean JCT against load, a panel a model and workload, a line a policy (a hollow marker:
    a run that did not finish every job). False where matplotlib does not import."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot

    keys = sorted(groups)
    figure, axes = pyplot.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for axis, key in zip(axes[0], keys, strict=True):
        by_load = groups[key]
        for policy in POLICIES:
            points = [(load, runs[policy]) for load, runs in sorted(by_load.items())
                      if policy in runs and _mean_jct(runs[policy]) is not None]
            if not points:
                continue
            line, = axis.plot([load for load, _ in points],
                              [_mean_jct(run) for _, run in points], marker="o", label=policy)
            unfinished = [(load, _mean_jct(run)) for load, run in points
                          if not finished_all(run)]
            if unfinished:
                axis.plot(*zip(*unfinished, strict=True), linestyle="none", marker="o",
                          markersize=9, markerfacecolor="white", color=line.get_color())
        axis.set_title(f"{key[0]}, {key[1]}")
        axis.set_xlabel("load (jobs/s)")
        axis.set_ylabel("mean JCT (s)")
        axis.grid(alpha=0.3)
        axis.set_ylim(bottom=0)
    axes[0][0].legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    groups = read_runs(args.folders)
    verdicts = {key: judge(by_load) for key, by_load in groups.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    text = markdown(groups, verdicts)
    (args.out / "paper.md").write_text(text)
    (args.out / "paper.json").write_text(json.dumps([
        {"model": model, "workload": workload, "judged_load": judged_load(by_load),
         "runs": {f"{load:g}": runs for load, runs in sorted(by_load.items())},
         "targets": [vars(verdict) for verdict in verdicts[(model, workload)]]}
        for (model, workload), by_load in sorted(groups.items())], indent=1) + "\n")
    print(text)
    if groups and plot(groups, args.out / "paper-jct.png"):
        print(f"wrote {args.out / 'paper-jct.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
