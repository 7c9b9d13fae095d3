"""`continuum bench sim`: policies compared on an agent trace, in simulated time.

Every (policy spec, load) pair is one discrete-event simulation (`eval.simulator`) of the
same jobs arriving by the same Poisson draw, on the real scheduler with the `simulated`
executor. A policy spec (`eval.policy_specs`) is `NAME` or `NAME:KEY=VALUE[:KEY=VALUE...]`
(the policy's own options, e.g. `continuum:estimator=eq2-learned`), optionally ending in
`+tier`: the same policy on an engine with a host KV tier (`fcfs+tier`,
`continuum:estimator=fixed-2s+tier`), as large as the profile's host memory unless
`--kv-offload-gib` says otherwise. The spec as written labels its rows.
The jobs come from a named workload (`--workload NAME`, `continuum bench workloads` lists them)
or a trace file (`--trace FILE`). Optionally, plain chat sessions (`--chat-workload NAME` or
`--chat-trace FILE`) arrive beside the jobs by their own Poisson process and are reported
apart. With `--replicas N`, each run serves the jobs with N engines behind one `--router`
(`engine.replicas.routing`), the policy spec applying to every engine; the routing (why each
request went where it did, and how many each replica got) is printed after the table.
Prints a markdown table; `--json` writes every run's figures, `--plot` the JCT-against-load
PNG. `--finished-by-s T` also counts the jobs each run finished within T s of the first
arrival (`num_finished_by_s`), to compare with a measured run stopped at T. Deterministic for
a seed, whatever `--workers`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zlib
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from engine.executor.roofline import DEFAULT_SIM_PROFILE, GIB
from engine.executor.sim_profiles import get_sim_profile, sim_profile_names
from engine.replicas.routing import DEFAULT_LOAD_FACTOR, DEFAULT_MIN_MOVE_LOAD, ROUTER_NAMES
from eval.arrivals import arrivals_s, poisson_arrivals_s, poisson_arrivals_within_s
from eval.policy_specs import (
    ABLATION_LADDER,
    DEFAULT_POLICIES,
    HOST_TIER_SUFFIX,
    PolicySpec,
    policy_specs,
)
from eval.replay_metrics import num_finished_by
from eval.report import markdown_table, plot_jct_vs_load
from eval.simulator import ChatLoad, SimSettings, Simulation
from eval.workload import AgentJobSpec, ChatSessionSpec, draw_sessions, load_chat_sessions
from eval.workload_flags import (
    add_workload_arguments,
    load_workload,
    positive_float,
    positive_int,
    positive_number,
    workload_summary,
)
from eval.workloads import add_trace_arguments, trace_source, workload_source
from tracing.pyplot import load_pyplot

VLLM_DEFAULT_CHUNK = 2048


def host_tier_gib(profile: str, kv_offload_gib: float | None = None) -> float:
    """The host tier of the `+tier` rows, in GiB: `kv_offload_gib`, else all of the
    profile's host memory."""
    if kv_offload_gib is not None:
        return kv_offload_gib
    return get_sim_profile(profile).host_memory_bytes / GIB


def parse_loads(text: str) -> list[float | None]:
    """`0.5,1,2` -> jobs per second; `all` means every job at once."""
    loads: list[float | None] = []
    for item in text.split(","):
        item = item.strip()
        if item == "all":
            loads.append(None)
            continue
        loads.append(positive_number(float, "a load", item))
    return loads


@dataclass(frozen=True)
class ChatWorkload:
    """Plain chat sessions beside the jobs: drawn with replacement from `sessions`, arriving
    by a Poisson process at `sessions_per_s`; `num_sessions` of them, or (None) as many as
    arrive within the jobs' arrival window (at least one). `label` names their workload or
    trace in reports."""

    sessions: tuple[ChatSessionSpec, ...]
    sessions_per_s: float
    num_sessions: int | None = None
    label: str = "chat"

    def load_for(self, job_arrivals_s: Sequence[float], seed: int) -> ChatLoad:
        """The sessions and their arrivals for a run whose jobs arrive at
        `job_arrivals_s`; seeded apart from the jobs' arrivals and draws."""
        arrival_seed = zlib.crc32(f"chat-arrivals:{seed}".encode())
        if self.num_sessions is None:
            times = poisson_arrivals_within_s(max(job_arrivals_s), self.sessions_per_s,
                                              seed=arrival_seed)
        else:
            times = poisson_arrivals_s(self.num_sessions, self.sessions_per_s, seed=arrival_seed)
        drawn = draw_sessions(self.sessions, len(times), seed=seed)
        return ChatLoad(tuple(drawn), tuple(times))


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "chat", "plain chat sessions beside the agent jobs, sent without a job (never pinned) "
                "and reported apart (chat_* figures); --token-scale applies to them")
    add_trace_arguments(group, prefix="chat-", required=False, kind="chat sessions")
    group.add_argument("--chat-sessions-per-s", type=positive_float, default=None,
                       metavar="RATE",
                       help="Poisson arrivals of sessions, seeded apart from the jobs' "
                            "(required with --chat-workload or --chat-trace)")
    group.add_argument("--chat-sessions", type=positive_int, default=None, metavar="N",
                       help="sessions drawn with replacement from the chat trace (default: "
                            "as many as arrive within the jobs' arrival window, at least one)")


def load_chat(args: argparse.Namespace) -> ChatWorkload | None:
    """The chat sessions the chat flags select; None without `--chat-workload` or
    `--chat-trace`. ValueError for flags given without the others, an unknown workload, or a
    trace that cannot be read."""
    source = trace_source(args, prefix="chat-")
    if source is None:
        if args.chat_sessions_per_s is not None or args.chat_sessions is not None:
            raise ValueError("--chat-sessions-per-s and --chat-sessions need --chat-workload "
                             "or --chat-trace")
        return None
    if args.chat_sessions_per_s is None:
        raise ValueError("--chat-workload and --chat-trace need --chat-sessions-per-s")
    sessions = load_chat_sessions(source.path, token_scale=args.token_scale,
                                  output_tokens_per_turn=args.output_tokens_per_turn)
    return ChatWorkload(tuple(sessions), args.chat_sessions_per_s, args.chat_sessions,
                        source.label)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    add_chat_arguments(parser)
    parser.add_argument("--profile", default=DEFAULT_SIM_PROFILE, metavar="NAME|FILE",
                        help=f"cost profile: {', '.join(sim_profile_names())}, or a measured "
                             "profile's JSON file (`continuum bench calibrate`) (default: "
                             f"{DEFAULT_SIM_PROFILE})")
    parser.add_argument("--policies", default=None, metavar="SPECS",
                        help="comma-separated policy specs NAME or NAME:KEY=VALUE[:KEY=VALUE"
                             "...], e.g. continuum:estimator=eq2-learned (`continuum serve "
                             "--help` lists each policy's options; a value holds no ':'), "
                             "ending in +tier for an engine with a host KV tier (fcfs+tier); "
                             "each spec is one row, labelled as written; 'ladder' = the "
                             f"paper's ablation {ABLATION_LADDER} (default: {DEFAULT_POLICIES})")
    parser.add_argument("--policy", action="append", default=[], metavar="SPEC",
                        help="one more policy spec, repeatable, for option values that "
                             "contain commas; runs after --policies (the default list only "
                             "if --policies is given)")
    parser.add_argument("--jobs-per-s", type=parse_loads, required=True,
                        help="comma-separated Poisson loads in jobs/s; 'all' = all at once")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV pool size (default: what the profile's memory holds)")
    parser.add_argument("--kv-offload-gib", type=positive_float, default=None, metavar="GIB",
                        help="host KV tier of the policy specs ending in +tier, in GiB "
                             "(default: the profile's host memory; specs without +tier run "
                             "without a tier)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=8192, metavar="N",
                        help="token budget of a step, the chunked-prefill size; vLLM's "
                             f"default chunk is {VLLM_DEFAULT_CHUNK:,} (default: 8,192)")
    parser.add_argument("--replicas", type=positive_int, default=1, metavar="N",
                        help="engines serving the jobs, each with the whole profile and the "
                             "row's policy, behind one router (default: 1)")
    parser.add_argument("--router", choices=ROUTER_NAMES, default="affinity",
                        help="how requests are spread over the replicas: 'affinity' keeps a "
                             "job's turns on one replica (bounded by load), 'round-robin' and "
                             "'least-loaded' ignore jobs (default: affinity)")
    parser.add_argument("--route-load-factor", type=positive_float, default=None,
                        metavar="F",
                        help="affinity's load bound: a job moves off a replica with more "
                             "than max(--route-min-move-load, F x the mean) requests in flight "
                             f"(default: {DEFAULT_LOAD_FACTOR:g})")
    parser.add_argument("--route-min-move-load", type=int, default=None, metavar="N",
                        help="the load bound's floor, in requests in flight (default: "
                             f"{DEFAULT_MIN_MOVE_LOAD})")
    parser.add_argument("--workers", type=int, default=1,
                        help="simulations run in parallel processes (default: 1)")
    parser.add_argument("--finished-by-s", type=positive_float, default=None, metavar="T",
                        help="also count the jobs finished within T s of the first arrival, "
                             "as a run stopped at T would have (default: none)")
    parser.add_argument("--json", default=None, help="write every run's figures here")
    parser.add_argument("--plot", default=None, help="write the JCT-against-load PNG here")


@dataclass(frozen=True)
class _SimTask:
    jobs: tuple[AgentJobSpec, ...]
    arrivals_s: tuple[float, ...]
    chat: ChatLoad
    settings: SimSettings
    spec: PolicySpec
    load: float | None
    finished_by_s: float | None = None


def run_comparison(
    jobs: Sequence[AgentJobSpec], settings: SimSettings, specs: Sequence[PolicySpec],
    loads: Sequence[float | None], *, workers: int = 1, chat: ChatWorkload | None = None,
    kv_offload_gib: float | None = None, finished_by_s: float | None = None,
) -> list[dict]:
    """One simulation per (policy spec, load); the runs' figures in (load, spec) order. The
    specs decide the host tier: `host_tier_gib(settings.profile, kv_offload_gib)` GiB for
    those ending in `+tier`, none for the others. With `finished_by_s`, each run also counts
    the jobs it finished by then (`num_finished_by_s`)."""
    tier_gib = host_tier_gib(settings.profile, kv_offload_gib)
    tasks = []
    for load in loads:
        times = tuple(arrivals_s(len(jobs), load, seed=settings.seed))
        chat_load = ChatLoad() if chat is None else chat.load_for(times, settings.seed)
        tasks.extend(
            _SimTask(tuple(jobs), times, chat_load,
                     replace(settings, policy=spec.policy, policy_options=spec.options,
                             kv_offload_gib=tier_gib if spec.host_tier else 0.0), spec, load,
                     finished_by_s)
            for spec in specs
        )
    if workers <= 1:
        return [_run_one(task) for task in tasks]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_run_one, tasks))


def _run_one(task: _SimTask) -> dict:
    started_s = time.perf_counter()
    simulation = Simulation(task.jobs, task.arrivals_s, task.settings, task.chat)
    metrics = simulation.run()
    cut = {} if task.finished_by_s is None else {
        "finished_by_s": task.finished_by_s,
        "num_finished_by_s": num_finished_by(simulation.records[:len(task.jobs)],
                                             task.finished_by_s)}
    return {"label": task.spec.label, "policy": task.spec.name,
            "policy_options": dict(task.spec.options), "jobs_per_s": task.load,
            "kv_offload_gib": task.settings.kv_offload_gib,
            "replicas": task.settings.num_replicas, **simulation.routing_summary().to_dict(),
            **metrics.to_dict(), **cut, "wall_s": time.perf_counter() - started_s}


ROUTING_KINDS = ("affinity", "placed", "moved", "rerouted", "spread")


def routing_table(runs: Sequence[dict]) -> str:
    """Per run: the requests routed by kind (`engine.replicas.routing.RoutingKind`), the
    share of a job's later turns that ran where its previous turn did, and each replica's
    requests."""
    lines = ["| jobs/s | policy | " + " | ".join(ROUTING_KINDS)
             + " | same replica as the previous turn | requests per replica |",
             "|---:|---|" + "---:|" * len(ROUTING_KINDS) + "---:|---|"]
    for run in runs:
        counts = run["routing_counts"]
        same = run["same_replica_turn_fraction"]
        load = "all at once" if run["jobs_per_s"] is None else f"{run['jobs_per_s']:g}"
        cells = [load, str(run["label"]), *(str(counts.get(kind, 0)) for kind in ROUTING_KINDS),
                 "-" if same is None else f"{same:.1%}",
                 " / ".join(str(n) for n in run["requests_per_replica"].values())]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chat_summary(chat: ChatWorkload) -> dict:
    """What the chat trace holds (before drawing)."""
    sessions = chat.sessions
    num_turns = sum(len(session.turns) for session in sessions)
    return {"num_sessions_in_trace": len(sessions),
            "mean_turns": num_turns / len(sessions),
            "mean_max_seq_len": sum(s.max_seq_len for s in sessions) / len(sessions),
            "sessions_per_s": chat.sessions_per_s, "num_sessions": chat.num_sessions}


def _route_load_bound(args: argparse.Namespace) -> dict[str, float | int]:
    """The `SimSettings` fields of the load-bound flags given; ValueError where no affinity
    router would use them."""
    given = {field: value for field, value in (("route_load_factor", args.route_load_factor),
                                               ("route_min_move_load", args.route_min_move_load))
             if value is not None}
    if given and args.router != "affinity":
        raise ValueError("--route-load-factor and --route-min-move-load bound the affinity "
                         f"router only, not {args.router!r}")
    return given


def main(args: argparse.Namespace) -> int:
    try:
        if args.plot:
            load_pyplot()  # before the runs, so that a missing matplotlib is said at once
        specs = policy_specs(args.policies, args.policy)
        if args.kv_offload_gib is not None and not any(spec.host_tier for spec in specs):
            raise ValueError(f"--kv-offload-gib sizes the host tier of the policy specs "
                             f"ending in +{HOST_TIER_SUFFIX}, and none does")
        bound = _route_load_bound(args)
        chat = load_chat(args)
        source = workload_source(args)
        jobs = load_workload(args)
        settings = SimSettings(
            policy=specs[0].policy, policy_options=specs[0].options, profile=args.profile,
            block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            seed=args.seed, num_replicas=args.replicas, router=args.router, **bound,
        )
        profile_name = get_sim_profile(args.profile).name
        runs = run_comparison(jobs, settings, specs, args.jobs_per_s, workers=args.workers,
                              chat=chat, kv_offload_gib=args.kv_offload_gib,
                              finished_by_s=args.finished_by_s)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    engines = profile_name if args.replicas == 1 else (
        f"{args.replicas} x {profile_name}, router {args.router}")
    title = f"{Path(source.label).name} on {engines} ({len(jobs)} jobs)"
    if chat is not None:
        title += f" with {Path(chat.label).name} sessions at {chat.sessions_per_s:g}/s"
    print(f"{title}\n\n{markdown_table(runs)}")
    if args.replicas > 1:
        print(f"\nRouting ({args.router}):\n\n{routing_table(runs)}")
    if args.json:
        excluded = ("policy", "policy_options", "kv_offload_gib")
        report = {"trace": source.label, "profile": profile_name,
                  "profile_source": args.profile,
                  "policies": [spec.label for spec in specs],
                  "settings": {k: v for k, v in asdict(settings).items() if k not in excluded},
                  "workload": workload_summary(jobs), "runs": runs}
        if chat is not None:
            report["chat"] = {"trace": chat.label, **chat_summary(chat)}
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot:
        plot_jct_vs_load(runs, args.plot, title=title)
    return 0
