"""Tenants over HTTP: each API key's tenant sees only its own jobs and, unless the server
shares it, only its own prefix cache; `cache_salt` is passed through."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from engine.entrypoints.openai.serving import ServerSettings
from engine.entrypoints.openai.tenants import (
    Tenants,
    engine_cache_salt,
    engine_job_id,
    parse_tenant_flag,
    read_keys_file,
)
from engine.entrypoints.server_args import tenants_from_args
from tests.engine.entrypoints.openai.conftest import ServerThread, start_server

KEYS = {"alpha": "key-a", "beta": "key-b"}
# Four full blocks of 16 tokens and more: a hit is unmistakable.
SECRET_PROMPT = [7, 9, 11, 13] * 20


def _settings(*, share_prefix_cache: bool = False) -> ServerSettings:
    tenants = Tenants.from_pairs([(key, name) for name, key in KEYS.items()],
                                 share_prefix_cache=share_prefix_cache)
    return ServerSettings(served_model_name="tiny", tenants=tenants)


@pytest.fixture(scope="module")
def tenant_server() -> Iterator[ServerThread]:
    running = start_server(settings=_settings(), api_key=KEYS["alpha"])
    yield running
    running.stop()


def _http(server: ServerThread, tenant: str) -> httpx.Client:
    return server.http(headers={"Authorization": f"Bearer {KEYS[tenant]}"})


def _cached_tokens(http: httpx.Client, **fields: object) -> int:
    response = http.post("/v1/completions", json={
        "model": "tiny", "prompt": SECRET_PROMPT, "max_tokens": 1, **fields})
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_another_tenants_job_is_a_404_and_cannot_be_deleted(tenant_server):
    with _http(tenant_server, "alpha") as alpha, _http(tenant_server, "beta") as beta:
        response = alpha.post("/v1/completions", json={
            "model": "tiny", "prompt": "a turn", "max_tokens": 2, "job_id": "shared-name"})
        assert response.status_code == 200, response.text
        assert alpha.get("/v1/jobs/shared-name").status_code == 200
        for answer in (beta.get("/v1/jobs/shared-name"), beta.delete("/v1/jobs/shared-name")):
            assert answer.status_code == 404
            assert answer.json()["error"]["code"] == "job_not_found"
        assert alpha.get("/v1/jobs/shared-name").json()["id"] == "shared-name"
        assert alpha.delete("/v1/jobs/shared-name").json()["deleted"] is True
    tenant_server.wait_idle()


def test_a_tenant_gets_no_cached_tokens_on_another_tenants_prompt(tenant_server):
    with _http(tenant_server, "alpha") as alpha, _http(tenant_server, "beta") as beta:
        _cached_tokens(alpha)
        assert _cached_tokens(alpha) >= 64  # alpha's own prompt is cached
        assert _cached_tokens(beta) == 0
        assert _cached_tokens(beta) >= 64  # beta now has a copy of its own
    stats = tenant_server.wait_idle()
    assert stats.num_free_blocks == stats.num_kv_blocks


def test_cache_salt_separates_requests_of_one_tenant(tenant_server):
    with _http(tenant_server, "alpha") as alpha:
        _cached_tokens(alpha, cache_salt="first")
        assert _cached_tokens(alpha, cache_salt="first") >= 64
        assert _cached_tokens(alpha, cache_salt="second") == 0
        response = alpha.post("/v1/completions", json={
            "model": "tiny", "prompt": "x", "max_tokens": 1, "cache_salt": ""})
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "cache_salt"
    tenant_server.wait_idle()


def test_unknown_keys_are_refused(tenant_server):
    for header in ("Bearer nope", "key-a", "Basic key-a", ""):
        response = httpx.get(tenant_server.base_url + "/v1/models",
                             headers={"Authorization": header})
        assert response.status_code == 401, header
        assert response.json()["error"]["code"] == "invalid_api_key"


def test_a_shared_prefix_cache_lets_tenants_hit_each_other():
    server = start_server(settings=_settings(share_prefix_cache=True), api_key=KEYS["alpha"])
    try:
        with _http(server, "alpha") as alpha, _http(server, "beta") as beta:
            _cached_tokens(alpha)
            assert _cached_tokens(beta) >= 64
            assert _cached_tokens(beta, cache_salt="own") == 0
        server.wait_idle()
    finally:
        server.stop()


def test_engine_ids_and_salts_never_meet_across_tenants():
    assert engine_job_id(None, "j") == "j"
    assert engine_job_id("alpha", "j") != engine_job_id("beta", "j")
    assert engine_job_id("alpha", "beta/j") != engine_job_id("beta", "j")
    salts = {engine_cache_salt(tenant, salt, share_prefix_cache=False)
             for tenant in ("alpha", "beta") for salt in (None, "x", "\x00x")}
    assert len(salts) == 6
    assert engine_cache_salt("alpha", "x", share_prefix_cache=True) == "x"
    assert engine_cache_salt(None, None, share_prefix_cache=False) is None


def test_keys_come_from_flags_and_a_file(tmp_path: Path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# key tenant\nkey-f  filed\n\nkey-g filed\n")
    args = argparse.Namespace(api_key=["key-d"], tenant=["named:key:with:colons"],
                              api_keys_file=str(keys_file), share_prefix_cache=False)
    tenants = tenants_from_args(args)
    assert tenants is not None
    assert {key: tenants.tenant_of(key.encode())
            for key in ("key-d", "key:with:colons", "key-f", "key-g", "other")} == {
        "key-d": "default", "key:with:colons": "named", "key-f": "filed", "key-g": "filed",
        "other": None}
    assert tenants_from_args(argparse.Namespace(
        api_key=[], tenant=[], api_keys_file=None, share_prefix_cache=False)) is None


@pytest.mark.parametrize(("make", "message"), [
    (lambda tmp: parse_tenant_flag("nokey"), "NAME:KEY"),
    (lambda tmp: parse_tenant_flag("bad/name:k"), "tenant name"),
    (lambda tmp: parse_tenant_flag("sk+s3cret=:alpha"), "^(?!.*s3cret)"),
    (lambda tmp: Tenants.from_pairs([("k", "a"), ("k", "b")]), "two tenants"),
    (lambda tmp: Tenants.from_pairs([("has space", "a")]), "whitespace"),
    (lambda tmp: Tenants.from_pairs([]), "at least one"),
    (lambda tmp: read_keys_file(tmp), "regular file"),
    (lambda tmp: (tmp / "k").write_text("one two three\n") and read_keys_file(tmp / "k"),
     "k:1"),
])
def test_malformed_keys_are_refused(tmp_path, make, message):
    with pytest.raises(ValueError, match=message):
        make(tmp_path)


def test_shared_cache_needs_keys():
    with pytest.raises(ValueError, match="needs API keys"):
        tenants_from_args(argparse.Namespace(api_key=[], tenant=[], api_keys_file=None,
                                             share_prefix_cache=True))
