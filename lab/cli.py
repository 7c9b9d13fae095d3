"""The lab's command line, `python -m lab NAME ...`: the commands of `lab.LAB_COMMANDS`, each
the module `lab.bench.<name with - replaced by _>`, parsed and run as `continuum`'s are."""

from __future__ import annotations

from collections.abc import Sequence

from engine import cli
from lab import LAB_COMMANDS

COMMANDS: cli.Commands = {name: (f"lab.bench.{name.replace('-', '_')}", help_text)
                          for name, help_text in LAB_COMMANDS.items()}


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the lab command of `argv` (default: the process's arguments)."""
    return cli.main(argv, COMMANDS, prog="python -m lab",
                    description="this repository's attack, load, soak and GPU benches")
