"""Merges the raw results of `scripts/gpu_bench.sh` into `results.json` and `summary.md`.

Usage: python eval/gpu/bench_report.py RAW_DIR OUT_DIR. RAW_DIR holds `environment.json`,
`status.tsv` (name, exit code, seconds of each step) and each step's JSON: `forward-*.json`
(`python -m lab forward`), `throughput-*.json` (`bench throughput --impl engine`), `agent-*.json`
and `paper-*.json` (`bench agent`: the agent part's replays and the paper part's, whose
targets `eval/gpu/paper_report.py` judges; the paper part's other JSONs are left out). On a
card `eval.gpu_floors` knows, each figure is also set against that card's own floor, when
the repository's root is on `PYTHONPATH` (as `gpu_bench.sh` runs it); the rest needs the
standard library only, so it runs wherever the script does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

try:
    from eval import gpu_floors
except ImportError:  # the repository's root is not on the path: no floors tables
    gpu_floors = None

if TYPE_CHECKING:
    from eval.gpu_floors import Card, ModelShape, Precision

_REPO = Path(__file__).resolve().parents[2]


def main(raw_dir: Path, out_dir: Path) -> int:
    results: dict[str, Any] = {
        "environment": json.loads((raw_dir / "environment.json").read_text()),
        "steps": _steps(raw_dir / "status.tsv"),
    }
    for kind in ("forward", "throughput", "agent", "paper"):
        results[kind] = {}
        for step in results["steps"]:  # in the order they ran
            path = raw_dir / f"{step['name']}.json"
            if step["name"].startswith(f"{kind}-") and path.is_file():
                report = json.loads(path.read_text())
                # The paper part's calibration check writes a JSON of its own.
                if kind == "paper" and "base_url" not in report:
                    continue
                results[kind][step["name"].removeprefix(f"{kind}-")] = report
    (out_dir / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    summary = summary_markdown(results)
    (out_dir / "summary.md").write_text(summary)
    print(summary)
    return 0


def _steps(status_path: Path) -> list[dict[str, Any]]:
    steps = []
    for line in status_path.read_text().splitlines():
        name, code, seconds = line.split("\t")
        steps.append({"name": name, "exit_code": int(code), "wall_s": float(seconds)})
    return steps


def summary_markdown(results: dict[str, Any]) -> str:
    """The environment, then one table per kind of step, then the steps that failed."""
    env = results["environment"]
    lines = [f"# GPU benchmark: {env['device']}", "",
             f"torch {env['torch']}, triton {env['triton']}, model {env['config']}, "
             f"mode {env['mode']}", ""]
    lines += _forward_table(results["forward"])
    lines += _throughput_table(results["throughput"])
    lines += _slow_steps_table(results["throughput"])
    try:
        lines += _floors_tables(results)
    # An optional table: whatever a run's fields or the interpreter's path hold, the report
    # that a stopped run relies on is still written.
    except Exception as error:
        lines += [f"(No floors: {type(error).__name__}: {error}.)", ""]
    lines += _agent_table(results["agent"], "Agent replay (`serve` + `bench agent`)")
    lines += _agent_table(results.get("paper", {}),
                          "The paper's comparison (`serve` + `bench agent`; paper.md judges it)")
    lines += ["## Steps", ""]
    for step in results["steps"]:
        lines.append(f"- {step['name']}: {_outcome(step)}, {step['wall_s']:.0f} s")
    return "\n".join(lines) + "\n"


# Exit codes `scripts/gpu_bench.sh` gives steps its --budget-s cut short (124: `timeout`'s).
_STOPPED_AT_BUDGET, _SKIPPED_FOR_BUDGET = 124, 125


def _outcome(step: dict[str, Any]) -> str:
    code = step["exit_code"]
    if code == 0:
        return "ok"
    if code == _SKIPPED_FOR_BUDGET:
        return "SKIPPED (the time budget was spent)"
    if code == _STOPPED_AT_BUDGET:
        return f"STOPPED at the time budget (raw/{step['name']}.log)"
    return f"FAILED (exit {code}; raw/{step['name']}.log)"


def _forward_table(runs: dict[str, Any]) -> list[str]:
    """Shapes as rows, runs as columns: ms a step and tokens/s."""
    if not runs:
        return []
    names = list(runs)
    header = "| shape | " + " | ".join(f"{name}: ms a step | {name}: tokens/s" for name in names)
    lines = ["## Forward steps through the model runner (`python -m lab forward`)", "",
             header + " |", "|---|" + "---:|---:|" * len(names)]
    by_label = {name: {r["label"]: r for r in run["results"]} for name, run in runs.items()}
    labels = dict.fromkeys(label for results in by_label.values() for label in results)
    for label in labels:
        cells = []
        for name in names:
            result = by_label[name].get(label)
            if result is None or result["error"] is not None:
                cells += [result["error"] if result else "not run", ""]
            else:
                cells += [f"{result['step_ms']:.2f}", f"{result['tokens_per_s']:,.0f}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return [*lines, "", *_profile_table(runs)]


def _profile_table(runs: dict[str, Any]) -> list[str]:
    """The profiled shapes (`python -m lab forward --profile`): launches and times a step."""
    rows = [(name, result) for name, run in runs.items() for result in run["results"]
            if result.get("profile")]
    if not rows:
        return []
    lines = ["Profiled steps (a step, from torch's profiler; the device's idle time inside "
             "the steps before its first kernel, between kernels and after its last):", "",
             "| run | shape | launches | graph launches | device busy (ms) | host (ms) | "
             "idle before / between / after (ms) |",
             "|---|---|---:|---:|---:|---:|---|"]
    for name, result in rows:
        profile = result["profile"]
        idle = profile.get("idle")  # absent from runs before 2026-11-27
        idle_cell = ("" if idle is None else f"{idle['before_first_ms']:.2f} / "
                     f"{idle['between_ms']:.2f} / {idle['after_last_ms']:.2f}")
        lines.append(f"| {name} | {result['label']} | {profile['launches_per_step']:,.0f} | "
                     f"{profile['graph_launches_per_step']:,.0f} | "
                     f"{profile['device_ms_per_step']:.2f} | {profile['host_ms_per_step']:.2f} | "
                     f"{idle_cell} |")
    return [*lines, ""]


def _throughput_table(runs: dict[str, Any]) -> list[str]:
    if not runs:
        return []
    lines = ["## Offline throughput (`bench throughput --impl engine`)", "",
             "| run | output tokens | wall (s) | output tokens/s | steps | ms a step | "
             "slowest steps (ms) | steps that freed device memory (s) |",
             "|---|---:|---:|---:|---:|---:|---|---|"]
    for name, run in runs.items():
        slowest = ", ".join(f"{step['wall_ms']:.0f}" for step in run.get("slow_steps", []))
        freeing = run.get("allocator_steps")
        freed = "" if freeing is None else f"{freeing['num_steps']} ({freeing['wall_s']:.2f})"
        lines.append(f"| {name} | {run['output_tokens']:,} | {run['wall_s']:.2f} | "
                     f"{run['tokens_per_s']:,.0f} | {run['num_steps']} | "
                     f"{run['wall_s'] / run['num_steps'] * 1e3:.1f} | {slowest} | {freed} |")
    return [*lines, ""]


def _slow_steps_table(runs: dict[str, Any]) -> list[str]:
    """Each run's slowest steps with where their time went, for runs that recorded it (since
    2026-11-28: the executor's launch and wait, collections, compiles)."""
    rows = [(name, step) for name, run in runs.items() for step in run.get("slow_steps", [])
            if "submit_ms" in step]
    if not rows:
        return []
    lines = ["The slowest steps (ms; launch and wait inside the executor, the rest outside it: "
             "scheduling and outputs; Python's collections of the oldest generation; Triton's "
             "compiles and loads from its disk cache):", "",
             "| run | step | running / waiting | wall | launch | wait | rest | "
             "oldest-generation collections (ms of all collections) | compiles |",
             "|---|---:|---|---:|---:|---:|---:|---|---|"]
    for name, step in rows:
        rest_ms = step["wall_ms"] - step["submit_ms"] - step["wait_ms"]
        compiles = ("not recorded" if step["triton_compiles"] is None
                    else ", ".join(step["triton_compiles"]) or "-")
        lines.append(f"| {name} | {step['index']} | {step['num_running']} / "
                     f"{step['num_waiting']} | {step['wall_ms']:.1f} | {step['submit_ms']:.1f} | "
                     f"{step['wait_ms']:.1f} | {rest_ms:.1f} | {step['gc_collections'][-1]} "
                     f"({step['gc_ms']:.1f}) | {compiles} |")
    return [*lines, ""]


def _floors_tables(results: dict[str, Any]) -> list[str]:
    """Each forward shape's and offline run's time over its floor on this card (1.00x: the
    floor), each run against its own precision's; nothing on a card without figures.
    A line saying so without the repository on the path."""
    if gpu_floors is None:
        return ["(No floors: `eval.gpu_floors` is not importable; put the repository's root "
                "on PYTHONPATH.)", ""]
    env = results["environment"]
    card = gpu_floors.card_of(env["device"])
    if card is None:
        return []
    tables = (_forward_floors(results["forward"], card, env["config"])
              + _throughput_floors(results["throughput"], card, env["config"]))
    if not tables:
        return []
    return [f"## Against the {card.name}'s floor (`eval/gpu_floors.py`)", "",
            "Measured time over the floor of this card's datasheet: the bytes a step must "
            "read at its bandwidth or its FLOPs at its peak rate, whichever is longer "
            "(1.00x is the floor; each run against its own precision's; a decode shape's "
            "floor takes its context, which its timed steps pass by up to 63 tokens).", "",
            *tables]


def _forward_floors(runs: dict[str, Any], card: Card, config: str) -> list[str]:
    """Shapes as rows, the runs of a known model as columns: time over the floor."""
    models = {name: model for name, run in runs.items()
              if (model := _model_shape(run["model"], config)) is not None}
    names = list(models)
    if not names:
        return []
    lines = ["| shape | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    by_label = {name: {r["label"]: r for r in runs[name]["results"]} for name in names}
    labels = dict.fromkeys(label for results in by_label.values() for label in results)
    for label in labels:
        cells = []
        for name in names:
            result = by_label[name].get(label)
            ratio = None if result is None else _shape_over_floor(runs[name], result, card,
                                                                  models[name])
            cells.append("" if ratio is None else f"{ratio:.2f}x")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def _shape_over_floor(run: dict[str, Any], result: dict[str, Any], card: Card,
                      model: ModelShape) -> float | None:
    """A shape's measured time a step over its floor: decode and extend steps by their
    milliseconds, prefills by their tokens a second (steps back to back included)."""
    if result["error"] is not None:
        return None
    batch, tokens = result["batch_size"], result["seq_len"]
    if result["kind"] == "decode":
        sequences = [(1, tokens)] * batch
    elif result["kind"] == "prefill":
        sequences = [(tokens, 0)] * batch
    else:
        sequences = ([(tokens, result["context_len"])] * batch
                     + [(1, result.get("decode_context_len", 0))]
                     * result.get("decodes_beside", 0))
    floor_s = gpu_floors.step_floor(model, card, _precision(run), sequences).lower_s
    if result["kind"] == "prefill":
        return batch * tokens / result["tokens_per_s"] / floor_s
    return result["step_ms"] / 1e3 / floor_s


def _throughput_floors(runs: dict[str, Any], card: Card, config: str) -> list[str]:
    """The offline runs that report their workload's counts: tokens/s against the floor's."""
    rows = [(name, run, _model_shape(run.get("model", Path(config).stem), config))
            for name, run in runs.items() if "workload" in run]
    rows = [(name, run, model) for name, run, model in rows if model is not None]
    if not rows:
        return []
    lines = ["| offline run | output tokens/s | the floor's tokens/s | time over the floor |",
             "|---|---:|---:|---:|"]
    for name, run, model in rows:
        counts = gpu_floors.WorkloadCounts(**run["workload"])
        floor_s = gpu_floors.run_floor(model, card, _precision(run), counts).lower_s
        lines.append(f"| {name} | {run['tokens_per_s']:,.0f} | "
                     f"{counts.output_tokens / floor_s:,.0f} | {run['wall_s'] / floor_s:.2f}x |")
    return [*lines, ""]


def _precision(run: dict[str, Any]) -> Precision:
    """A 16-bit run's precision (CUDA runs are bfloat16); an older report without the fields
    is taken as bf16 throughout."""
    return gpu_floors.Precision.of_run(run.get("quantization", "none"),
                            run.get("kv_cache_dtype", "auto"))


def _model_shape(model_name: str, config: str) -> ModelShape | None:
    """The shape of the model a run names: the benchmark's config, or the repository's
    config of that name; None if neither is found."""
    for path in (Path(config), _REPO / "engine/model/configs" / f"{model_name}.json"):
        if path.stem == model_name and path.is_file():
            return gpu_floors.ModelShape.from_file(path)
    return None


def _agent_table(runs: dict[str, Any], title: str) -> list[str]:
    if not runs:
        return []
    lines = [f"## {title}", "",
             "| run | jobs done | mean / p90 / p99 JCT (s) | cached tokens | preemptions | "
             "recomputed tokens |",
             "|---|---:|---|---:|---:|---:|"]
    for name, report in runs.items():
        run = report["runs"][0]
        stop_after_s = run.get("stop_after_s")
        done = f"{run['num_finished_jobs']}/{run['num_jobs']}"
        if stop_after_s is not None:
            done += f" by {stop_after_s:g} s"
        lines.append(f"| {name} | {done} | "
                     f"{_seconds(run['mean_jct_s'])} / {_seconds(run['p90_jct_s'])} / "
                     f"{_seconds(run['p99_jct_s'])} | {run['cached_token_fraction']:.1%} | "
                     f"{run['preemptions']} | {run.get('recomputed_tokens')} |")
    return [*lines, ""]



def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
