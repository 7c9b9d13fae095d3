"""`continuum models list`: every catalogued model, and whether the model cache
(`$CONTINUUM_MODEL_CACHE`, else `~/.cache/continuum/models`) has it."""

from __future__ import annotations

import argparse

from engine.model.catalog import CATALOG, checkout_bytes, model_cache_dir, read_manifest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options: the cache is `$CONTINUUM_MODEL_CACHE`'s, as for every command."""


def main(args: argparse.Namespace) -> int:
    cache_dir = model_cache_dir()
    print(f"model cache: {cache_dir}")
    for name, model in CATALOG.items():
        directory = cache_dir / name
        if read_manifest(directory) is None:
            state = f"not pulled (continuum models pull {name})"
        else:
            state = f"{checkout_bytes(directory) / 1e6:.0f} MB in {directory}"
        print(f"{name}  {model.requirement}  {model.license}  {state}")
    return 0
