"""The `continuum` console script.

The top layer (docs/architecture.md, 'Layers'). Subcommands are named here as `module` paths
and imported only when run, so `continuum --help` stays fast and heavy dependencies load only
for the command that needs them; the benchmarks are the commands `eval.bench` lists (it
imports only the standard library). Each command module provides `add_arguments(parser)` and
`main(args) -> int`. The lab's benches (`python -m lab`, from a checkout) run through `main`
with their own commands.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from eval.bench import BENCH_COMMANDS


def _bench_commands() -> dict[str, tuple[str, str]]:
    """`continuum bench`'s commands as `eval.bench.BENCH_COMMANDS` names them; command
    `name`'s module is `eval.bench.<name, - as _>`."""
    return {name: (f"eval.bench.{name.replace('-', '_')}", help_text)
            for name, help_text in BENCH_COMMANDS.items()}


# A command by its name: (its module, its help), or a group of such commands.
Commands = dict[str, tuple[str, str] | dict[str, tuple[str, str]]]

COMMANDS: Commands = {
    "serve": ("engine.entrypoints.serve", "the OpenAI-compatible HTTP server"),
    "models": {
        "pull": ("engine.entrypoints.models.pull", "fetch a catalogued model into the cache"),
        "list": ("engine.entrypoints.models.list_cached", "catalogued models and the cache"),
        "path": ("engine.entrypoints.models.path", "where a pulled model's checkout is"),
    },
    "bench": _bench_commands(),
    "trace": {
        "summarize": ("tracing.summary", "per-job, per-turn, cache and pin figures of a trace"),
        "timeline": ("tracing.timeline", "a PNG of jobs over time and the block pool"),
        "compare": ("tracing.compare", "two traces' summaries side by side"),
    },
}


def build_parser(argv: Sequence[str], commands: Commands | None = None, *,
                 prog: str = "continuum", description: str | None = None,
                 ) -> argparse.ArgumentParser:
    """The parser of `commands` (default `COMMANDS`); only the subcommand named in `argv` has
    its module imported."""
    parser = argparse.ArgumentParser(prog=prog,
                                     description=description or __doc__.splitlines()[0])
    groups = parser.add_subparsers(dest="group", required=True, metavar="COMMAND")
    for group, members in (COMMANDS if commands is None else commands).items():
        if isinstance(members, tuple):
            _add_command(groups, group, members, selected=list(argv[:1]) == [group])
            continue
        group_parser = groups.add_parser(group, help=f"{group} commands")
        subparsers = group_parser.add_subparsers(dest="command", required=True, metavar="NAME")
        for name, command in members.items():
            _add_command(subparsers, name, command, selected=list(argv[:2]) == [group, name])
    return parser


def _add_command(
    subparsers: argparse._SubParsersAction, name: str, command: tuple[str, str], *,
    selected: bool,
) -> None:
    module_path, help_text = command
    sub = subparsers.add_parser(name, help=help_text)
    if selected:
        module = importlib.import_module(module_path)
        module.add_arguments(sub)
        sub.set_defaults(run=module.main)


def main(argv: Sequence[str] | None = None, commands: Commands | None = None, *,
         prog: str = "continuum", description: str | None = None) -> int:
    """Runs the command of `argv` (default: the process's arguments) among `commands`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv, commands, prog=prog, description=description).parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
