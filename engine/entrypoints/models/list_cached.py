"""`continuum models list`: every catalogued model, and whether the cache has it."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.model.catalog import (
    CACHE_DIR_ENV,
    CATALOG,
    checkout_bytes,
    model_cache_dir,
    read_manifest,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"the model cache (default ${CACHE_DIR_ENV}, else "
                             "~/.cache/continuum/models)")


def main(args: argparse.Namespace) -> int:
    cache_dir = model_cache_dir() if args.cache_dir is None else args.cache_dir
    print(f"model cache: {cache_dir}")
    for name, model in CATALOG.items():
        directory = cache_dir / name
        if read_manifest(directory) is None:
            state = f"not pulled (continuum models pull {name})"
        else:
            state = f"{checkout_bytes(directory) / 1e6:.0f} MB in {directory}"
        print(f"{name}  {model.requirement}  {model.license}  {state}")
    return 0
