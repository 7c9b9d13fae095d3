"""Named workloads: the agent-job traces that ship with the package, and how a command picks one.

The files beside this module are byte-for-byte copies of converted public traces; their format,
provenance and licences are in `SOURCES.md` here. A command takes a workload by name
(`--workload swe`) or any trace file in the same format (`--trace FILE`), never both;
`continuum bench workloads` lists the names. This module owns the names and the paths only:
`eval.workload` loads a file, `estimator.traces` reads one for the estimators.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal, get_args

WORKLOAD_DIR = Path(__file__).resolve().parent
# Per-tool-class quantiles (seconds) that synthesise missing tool durations; a trace file picks
# up the one beside it, so every named workload uses this one.
QUANTILES_FILE = "tool_duration_quantiles.json"
TOOL_QUANTILES_PATH = WORKLOAD_DIR / QUANTILES_FILE

WorkloadName = Literal["swe", "web-search", "bfcl", "swesmith", "mooncake"]
WorkloadKind = Literal["agent jobs", "chat sessions"]


@dataclass(frozen=True)
class Workload:
    """A shipped trace: `file_name` in `WORKLOAD_DIR`, read as `kind` (agent jobs replay
    turns with tool calls; chat sessions are plain chat, for `--chat-workload`); `source` and
    `licence` in a few words, the full account in `SOURCES.md`."""

    name: WorkloadName
    file_name: str
    kind: WorkloadKind
    source: str
    licence: str

    @property
    def path(self) -> Path:
        return WORKLOAD_DIR / self.file_name


@dataclass(frozen=True)
class TraceCounts:
    """What a trace file holds: `num_records` jobs (or sessions) and `num_turns` in all."""

    num_records: int
    num_turns: int


WORKLOADS: Mapping[str, Workload] = MappingProxyType({w.name: w for w in (
    Workload("swe", "minisweagent_deepseek_jobs.jsonl", "agent jobs",
             "mini-swe-agent SWE-bench runs with DeepSeek (SWE-agent/mini-swe-agent PR 816)",
             "MIT"),
    Workload("web-search", "continuum_upstream_websearch_jobs.jsonl", "agent jobs",
             "BFCL web-search agent served by the Continuum preview (Hanchenli/vllm-continuum)",
             "Apache-2.0"),
    Workload("bfcl", "bfcl_multi_turn_base_skeleton.jsonl", "agent jobs",
             "BFCL v4 multi-turn base tasks, estimated tokens (ShishirPatil/gorilla)",
             "Apache-2.0"),
    Workload("swesmith", "continuum_swesmith_test5_jobs.jsonl", "agent jobs",
             "5 SWE-smith trajectories with measured tool times (Hanchenli/vllm-continuum)",
             "Apache-2.0"),
    Workload("mooncake", "mooncake_conversation_sessions.jsonl", "chat sessions",
             "Mooncake FAST'25 conversation trace (kvcache-ai/Mooncake)", "Apache-2.0"),
)})
assert set(WORKLOADS) == set(get_args(WorkloadName))


def get_workload(name: str) -> Workload:
    """The workload called `name`; ValueError listing the known names otherwise."""
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}") from None


def count_records(path: str | Path) -> TraceCounts:
    """Jobs (or sessions) and turns of a trace file, without interpreting the turns.
    ValueError if it cannot be read or a line is not a record with a list of turns."""
    num_records = num_turns = 0
    try:
        with open(path) as lines:
            for line_number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record, dict):
                    raise ValueError(f"{path}:{line_number}: not a JSON object")
                turns = record.get("turns")
                if not isinstance(turns, list):
                    raise ValueError(f"{path}:{line_number}: no list of turns")
                num_records += 1
                num_turns += len(turns)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"cannot read trace {path}: {error}") from error
    return TraceCounts(num_records, num_turns)


@dataclass(frozen=True)
class TraceSource:
    """Where a command's jobs come from: a shipped workload (`workload` set) or a file."""

    path: Path
    workload: Workload | None = None

    @property
    def label(self) -> str:
        """How reports name it: the workload's name, or the file as given."""
        return str(self.path) if self.workload is None else self.workload.name


def add_trace_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, prefix: str = "",
    required: bool = True, kind: WorkloadKind = "agent jobs",
) -> None:
    """`--{prefix}workload NAME` and `--{prefix}trace FILE`, mutually exclusive; one of them
    is needed when `required`. The help suggests the workloads of `kind`; any name is
    accepted."""
    names = ", ".join(w.name for w in WORKLOADS.values() if w.kind == kind)
    choice = parser.add_mutually_exclusive_group(required=required)
    choice.add_argument(f"--{prefix}workload", default=None, metavar="NAME",
                        help=f"a shipped workload of {kind}: {names} (`continuum bench "
                             "workloads` lists every workload)")
    choice.add_argument(f"--{prefix}trace", default=None, metavar="FILE",
                        help=f"{kind} from a JSONL file in the agent-job format "
                             "(eval/workloads/SOURCES.md)")


def trace_source(args: argparse.Namespace, *, prefix: str = "") -> TraceSource | None:
    """The source `add_trace_arguments` flags name; None if neither was given. ValueError
    for an unknown workload name."""
    dest = prefix.replace("-", "_")
    name = getattr(args, f"{dest}workload")
    if name is not None:
        workload = get_workload(name)
        return TraceSource(workload.path, workload)
    path = getattr(args, f"{dest}trace")
    return None if path is None else TraceSource(Path(path))


def workload_source(args: argparse.Namespace) -> TraceSource:
    """The workload or trace the flags of a command that requires one name (argparse saw to
    it). ValueError for an unknown workload name."""
    source = trace_source(args)
    assert source is not None, "argparse requires --workload or --trace"
    return source
