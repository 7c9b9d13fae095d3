"""Judges issue 36's policy targets on the `bench sim` JSONs of `scripts/policy_targets.sh`.

Usage: python scripts/policy_targets_report.py DIR_OR_JSON... [--candidate LABEL ...]
                                                [--variant OPTIONS] [--stand-in NAME=LABEL ...]

A cell is one (set, profile, workload, jobs drawn, seed, load): the runs of one `bench sim`
JSON at one `jobs_per_s`. A file in a folder named `tuning` (below a folder named) belongs
to the tuning set, any other to the held-out set; the two are reported apart. In every cell,
each candidate (default: `continuum` and every policy spec beyond the ladder) is judged
against the ladder's runs:

- oracle: mean JCT at most 1.10 x continuum-oracle's;
- fixed: mean JCT at most 1.02 x continuum-fixed's;
- fcfs: mean JCT at most 1.01 x fcfs's (never worse, 1 % of noise);
- recompute: recomputed tokens at most max(1.2 x fcfs's, fcfs's + 1,000);
- baselines: mean JCT at most 1.02 x the best mean JCT of fcfs, job-fcfs, continuum-fixed,
  infercept and autellix (issue 96; the cell needs every one of their runs);
- baselines-p99: p99 JCT no worse than the best p99 JCT of those baselines.

With `--variant OPTIONS` (such as `service_weight=1`), the ladder is judged as it would
run with those options as its defaults: in every cell, a run labelled `NAME:OPTIONS` for a
ladder policy NAME stands for NAME, and NAME's own run is dropped where there is none (the
cell is then not judged against it); fcfs, which takes no options, stays as it is. With
`--stand-in NAME=LABEL`, the run labelled LABEL stands for NAME instead: NAME itself for a
policy that does not use the variant's options (continuum-fixed and job-fcfs do not use R).

Prints markdown: a summary (cells met of those judged, and the missed ones, per set,
candidate and target), then a table per target listing every cell with its figures, then
every policy's mean JCT and recomputed tokens per cell. A cell lacking a figure (no such run,
no finished job, a JSON written before `recomputed_tokens`) is `n/a` and not judged. Always
exits 0: the verdicts are the output. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LADDER = ("fcfs", "job-fcfs", "continuum-fixed", "continuum", "continuum-oracle")
# The baselines issue 96's targets set `continuum` against: the best of them in each cell.
BASELINES = ("fcfs", "job-fcfs", "continuum-fixed", "infercept", "autellix")
BEST_BASELINE = "best baseline"
DEFAULT_CANDIDATE = "continuum"
TUNING_FOLDER = "tuning"
SETS = ("held-out", "tuning")
RECOMPUTE_FACTOR = 1.2
RECOMPUTE_SLACK_TOKENS = 1_000


@dataclass(frozen=True, order=True)
class CellKey:
    set_name: str
    profile: str
    workload: str
    num_jobs: int
    seed: int
    jobs_per_s: float

    def cells(self) -> list[str]:
        return [self.profile, self.workload, str(self.num_jobs), str(self.seed),
                f"{self.jobs_per_s:g}"]


CELL_COLUMNS = ["profile", "workload", "jobs", "seed", "jobs/s"]


@dataclass
class Cell:
    key: CellKey
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)  # by label


@dataclass(frozen=True)
class Verdict:
    """One candidate against one target in one cell; `met` None: a figure is missing."""

    met: bool | None
    candidate: str
    reference: str
    comparison: str


@dataclass(frozen=True)
class Target:
    name: str
    statement: str
    reference_label: str
    reference_column: str
    judge: Callable[[dict[str, Any], dict[str, Any]], Verdict]


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _tokens(value: int | None) -> str:
    return "n/a" if value is None else f"{value:,}"


def _jct_within(factor: float) -> Callable[[dict[str, Any], dict[str, Any]], Verdict]:
    """Candidate's mean JCT at most `factor` x the reference's."""
    def judge(candidate: dict[str, Any], reference: dict[str, Any]) -> Verdict:
        mine, theirs = candidate.get("mean_jct_s"), reference.get("mean_jct_s")
        if mine is None or theirs is None or theirs <= 0:
            return Verdict(None, _seconds(mine), _seconds(theirs), "n/a")
        ratio = mine / theirs
        return Verdict(ratio <= factor, _seconds(mine), _seconds(theirs),
                       f"{ratio:.3f}x (bound {factor:g}x)")
    return judge


def _p99_within(factor: float) -> Callable[[dict[str, Any], dict[str, Any]], Verdict]:
    """Candidate's p99 JCT at most `factor` x the reference's."""
    def judge(candidate: dict[str, Any], reference: dict[str, Any]) -> Verdict:
        mine, theirs = candidate.get("p99_jct_s"), reference.get("p99_jct_s")
        if mine is None or theirs is None or theirs <= 0:
            return Verdict(None, _seconds(mine), _seconds(theirs), "n/a")
        ratio = mine / theirs
        return Verdict(ratio <= factor, _seconds(mine), _seconds(theirs),
                       f"{ratio:.3f}x (bound {factor:g}x)")
    return judge


def _recompute_bound(candidate: dict[str, Any], reference: dict[str, Any]) -> Verdict:
    mine, theirs = candidate.get("recomputed_tokens"), reference.get("recomputed_tokens")
    if mine is None or theirs is None:
        return Verdict(None, _tokens(mine), _tokens(theirs), "n/a")
    bound = max(RECOMPUTE_FACTOR * theirs, theirs + RECOMPUTE_SLACK_TOKENS)
    return Verdict(mine <= bound, _tokens(mine), _tokens(theirs),
                   f"bound {bound:,.0f}, {mine - bound:+,.0f}")


TARGETS = (
    Target("oracle", "mean JCT within 10 % of continuum-oracle's", "continuum-oracle",
           "oracle mean JCT (s)", _jct_within(1.10)),
    Target("fixed", "mean JCT at most 2 % worse than continuum-fixed's", "continuum-fixed",
           "fixed mean JCT (s)", _jct_within(1.02)),
    Target("fcfs", "mean JCT never worse than fcfs's (within 1 %)", "fcfs",
           "fcfs mean JCT (s)", _jct_within(1.01)),
    Target("recompute", "recomputed tokens at most max(1.2 x fcfs's, fcfs's + 1,000)", "fcfs",
           "fcfs recomputed tokens", _recompute_bound),
    Target("baselines", "mean JCT at most 1.02 x the best baseline's", BEST_BASELINE,
           "best baseline's mean JCT (s)", _jct_within(1.02)),
    Target("baselines-p99", "p99 JCT no worse than the best baseline's p99", BEST_BASELINE,
           "best baseline's p99 JCT (s)", _p99_within(1.0)),
)


def best_baseline(cell: Cell, metric: str) -> dict[str, Any] | None:
    """A run standing for the best of `BASELINES` in the cell on `metric` (its figure, named
    by the baseline it came from); None unless every baseline ran there."""
    runs = [(label, cell.runs.get(label)) for label in BASELINES]
    if any(run is None or run.get(metric) is None for _, run in runs):
        return None
    label, run = min(runs, key=lambda item: item[1][metric])  # type: ignore[index]
    return {metric: run[metric], "label": label}  # type: ignore[index]


def json_files(paths: Iterable[Path]) -> list[tuple[Path, str]]:
    """The JSON files named, and those under the folders named, each with its set: tuning if
    a folder below the folder named, or any folder in the path of a file named, is `tuning`."""
    files: list[tuple[Path, str]] = []
    for path in paths:
        if path.is_dir():
            files.extend((file, _set_of(file.relative_to(path).parent.parts))
                         for file in sorted(path.rglob("*.json")))
        else:
            files.append((path, _set_of(path.parent.parts)))
    return files


def _set_of(folders: Sequence[str]) -> str:
    return "tuning" if TUNING_FOLDER in folders else "held-out"


def load_cells(files: Iterable[tuple[Path, str]]) -> tuple[list[Cell], list[str]]:
    """The cells of every `bench sim` report among `files` (path, set), in key order, and a
    note per file that is not one (skipped)."""
    cells: dict[CellKey, Cell] = {}
    notes = []
    for path, set_name in files:
        try:
            report = json.loads(path.read_text())
            profile = str(report["profile"])
            workload = Path(str(report["trace"])).name
            num_jobs = int(report["workload"]["num_jobs"])
            seed = int(report["settings"]["seed"])
            runs = report["runs"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            notes.append(f"skipped {path}: not a bench sim report ({error!r})")
            continue
        for run in runs:
            if run.get("jobs_per_s") is None:
                continue  # all at once: no load to judge at
            key = CellKey(set_name, profile, workload, num_jobs, seed,
                          float(run["jobs_per_s"]))
            label = str(run.get("label") or run["policy"])
            cells.setdefault(key, Cell(key)).runs[label] = run
    return [cells[key] for key in sorted(cells)], notes


def apply_variant(cells: Sequence[Cell], options: str | None,
                  stand_ins: Mapping[str, str] | None = None) -> None:
    """Each cell's run labelled `NAME:options` becomes NAME's run, for every ladder NAME but
    fcfs (which takes no options) and those of `stand_ins`; NAME's own run is dropped where
    there is no such run. `stand_ins` maps a ladder NAME to the label of the run that stands
    for it (NAME itself for a policy that does not use the variant's options), dropped too
    where the cell has none."""
    stand_ins = stand_ins or {}
    for cell in cells:
        chosen = {name: cell.runs.get(label) for name, label in stand_ins.items()}
        for label in stand_ins.values():
            cell.runs.pop(label, None)
        for name in LADDER[1:]:
            if name in stand_ins or options is None:
                continue
            varied = cell.runs.pop(f"{name}:{options}", None)
            if varied is None:
                cell.runs.pop(name, None)
            else:
                cell.runs[name] = varied
        for name, run in chosen.items():
            if run is None:
                cell.runs.pop(name, None)
            else:
                cell.runs[name] = run


def default_candidates(cells: Sequence[Cell]) -> list[str]:
    """`continuum`, then every label beyond the ladder and the baselines in first-seen
    order."""
    labels = dict.fromkeys(label for cell in cells for label in cell.runs)
    return [DEFAULT_CANDIDATE] + [label for label in labels
                                  if label not in LADDER and label not in BASELINES]


def judge(cell: Cell, target: Target, candidate: str) -> Verdict:
    mine = cell.runs.get(candidate)
    if target.reference_label == BEST_BASELINE:
        metric = "p99_jct_s" if target.name == "baselines-p99" else "mean_jct_s"
        theirs = best_baseline(cell, metric)
    else:
        theirs = cell.runs.get(target.reference_label)
    verdict = target.judge(mine or {}, theirs or {})
    if target.reference_label == BEST_BASELINE and theirs is not None:
        verdict = Verdict(verdict.met, verdict.candidate,
                          f"{verdict.reference} ({theirs['label']})", verdict.comparison)
    missing = [label for label, run in ((candidate, mine), (target.reference_label, theirs))
               if run is None]
    if missing:
        return Verdict(None, verdict.candidate, verdict.reference,
                       "no " + " nor ".join(missing) + " run")
    return verdict


def _verdict_word(met: bool | None) -> str:
    return {True: "met", False: "**MISSED**", None: "n/a"}[met]


def _markdown(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def summary_lines(cells: Sequence[Cell], candidates: Sequence[str]) -> list[str]:
    """Per set, candidate and target: cells met of those judged, and the first missed ones."""
    rows = []
    for set_name in SETS:
        in_set = [cell for cell in cells if cell.key.set_name == set_name]
        if not in_set:
            continue
        for candidate in candidates:
            for target in TARGETS:
                verdicts = [(cell, judge(cell, target, candidate)) for cell in in_set]
                judged = [(c, v) for c, v in verdicts if v.met is not None]
                missed = [c for c, v in judged if not v.met]
                missed_text = "; ".join(
                    f"{c.key.profile} {c.key.workload} s{c.key.seed} @{c.key.jobs_per_s:g}"
                    for c in missed[:4]) + (" ..." if len(missed) > 4 else "")
                rows.append([set_name, candidate, target.name,
                             f"{len(judged) - len(missed)}/{len(judged)}",
                             str(len(verdicts) - len(judged)), missed_text or "-"])
    return _markdown(["set", "candidate", "target", "cells met", "not judged", "missed"],
                     rows)


def target_lines(cells: Sequence[Cell], target: Target, candidate: str) -> list[str]:
    header = ["set", *CELL_COLUMNS, candidate, target.reference_column, "comparison",
              "verdict"]
    rows = []
    for cell in cells:
        verdict = judge(cell, target, candidate)
        rows.append([cell.key.set_name, *cell.key.cells(), verdict.candidate,
                     verdict.reference, verdict.comparison, _verdict_word(verdict.met)])
    return _markdown(header, rows)


def runs_lines(cells: Sequence[Cell]) -> list[str]:
    """Every policy's mean JCT (s) / recomputed tokens, one row per cell."""
    labels = list(dict.fromkeys(label for cell in cells for label in cell.runs))
    rows = []
    for cell in cells:
        figures = []
        for label in labels:
            run = cell.runs.get(label)
            figures.append("-" if run is None else
                           f"{_seconds(run.get('mean_jct_s'))} / "
                           f"{_tokens(run.get('recomputed_tokens'))}")
        rows.append([cell.key.set_name, *cell.key.cells(), *figures])
    return _markdown(["set", *CELL_COLUMNS, *labels], rows)


def report(cells: Sequence[Cell], candidates: Sequence[str], notes: Sequence[str],
           variant: str | None = None, stand_ins: Mapping[str, str] | None = None) -> str:
    lines = ["# The policy targets (issues 36 and 96)", ""]
    if variant is not None:
        lines += [f"The ladder with `{variant}`: runs labelled `NAME:{variant}` stand for NAME.",
                  ""]
    for name, label in (stand_ins or {}).items():
        lines += [f"`{name}` is the run labelled `{label}`.", ""]
    if not cells:
        return "\n".join([*lines, "No bench sim runs found.", *notes]) + "\n"
    sets = [s for s in SETS if any(cell.key.set_name == s for cell in cells)]
    lines += [f"{len(cells)} cells ({', '.join(sets)}); candidates: {', '.join(candidates)}.",
              "Tune on the tuning set; the held-out set is the one to report.", "",
              "## Summary", "", *summary_lines(cells, candidates), ""]
    for target in TARGETS:
        for candidate in candidates:
            lines += [f"## {target.name}: {candidate}, {target.statement}", "",
                      *target_lines(cells, target, candidate), ""]
    lines += ["## Every run: mean JCT (s) / recomputed tokens", "", *runs_lines(cells)]
    if notes:
        lines += ["", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", type=Path,
                        help="bench sim JSONs, or folders searched for them")
    parser.add_argument("--candidate", action="append", default=None, metavar="LABEL",
                        help="a policy spec to judge, as its runs are labelled (repeatable; "
                             "default: continuum and every spec beyond the ladder)")
    parser.add_argument("--variant", default=None, metavar="OPTIONS",
                        help="judge the ladder run with these options (runs labelled "
                             "NAME:OPTIONS stand for the ladder's NAME)")
    parser.add_argument("--stand-in", action="append", default=[], metavar="NAME=LABEL",
                        type=_stand_in, help="the run labelled LABEL stands for the "
                        "ladder's NAME, whatever --variant says (repeatable; LABEL = NAME "
                        "for a policy that does not use the variant's options)")
    args = parser.parse_args(argv)
    cells, notes = load_cells(json_files(args.paths))
    stand_ins = dict(args.stand_in)
    if args.variant is not None or stand_ins:
        apply_variant(cells, args.variant, stand_ins)
    candidates = args.candidate or default_candidates(cells)
    sys.stdout.write(report(cells, candidates, notes, args.variant, stand_ins))
    return 0


def _stand_in(text: str) -> tuple[str, str]:
    name, _, label = text.partition("=")
    if name not in LADDER[1:] or not label:
        raise argparse.ArgumentTypeError(
            f"expected NAME=LABEL with NAME one of {', '.join(LADDER[1:])}, got {text!r}")
    return name, label


if __name__ == "__main__":
    sys.exit(main())
