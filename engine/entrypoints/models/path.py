"""`continuum models path NAME`: print where a pulled model's checkout is (exit status 1,
with the command that fetches it, when the model cache does not have it)."""

from __future__ import annotations

import argparse
import sys

from engine.model.catalog import CATALOG, cached_checkout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", choices=list(CATALOG),
                        help=f"a catalogued model: {', '.join(CATALOG)}")


def main(args: argparse.Namespace) -> int:
    try:
        print(cached_checkout(args.name))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
