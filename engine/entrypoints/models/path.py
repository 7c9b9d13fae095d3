"""`continuum models path NAME`: print where a pulled model's checkout is (exit status 1,
with the command that fetches it, when the cache does not have it)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.model.catalog import CACHE_DIR_ENV, CATALOG, cached_checkout


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", choices=list(CATALOG),
                        help=f"a catalogued model: {', '.join(CATALOG)}")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"the model cache (default ${CACHE_DIR_ENV}, else "
                             "~/.cache/continuum/models)")


def main(args: argparse.Namespace) -> int:
    try:
        print(cached_checkout(args.name, args.cache_dir))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
