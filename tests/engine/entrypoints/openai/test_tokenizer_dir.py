"""A checkpoint without tokenizer files: served with `--tokenizer DIR` (every tokenizer loader,
the engine core's included, reads that directory), refused with a clear error without it."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.cli import build_parser
from engine.engine_args import EngineArgs
from engine.entrypoints.openai.serving import ServerSettings
from engine.model.tiny import TINY_MODEL_DIR
from engine.model.tokenizer import load_decoder, load_tokenizer, tokenizer_dir
from tests.continuum.priced import PRICED_CONTINUUM_PATH
from tests.engine.entrypoints.openai.conftest import SCRIPTED, ServerThread, start_server

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def weights_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's config alone (its weights are drawn from the seed, as with
    `--load-format dummy`): no tokenizer file, no chat template."""
    directory = tmp_path_factory.mktemp("weights-only")
    shutil.copy(TINY_MODEL_DIR / "config.json", directory / "config.json")
    return directory


@pytest.fixture(scope="module")
def served(weights_only: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[ServerThread]:
    """The weights-only checkpoint with the tiny tokenizer; turns call `bash` (scripted), and
    the default policy reads the tool from the output in the engine core."""
    profile = tmp_path_factory.mktemp("profile") / "profile.json"
    profile.write_text(json.dumps({"points": [[0, 4.0], [1000, 4.0]]}))
    server = start_server(model=str(weights_only), tokenizer=str(TINY_MODEL_DIR),
                          load_format="dummy", executor=f"{SCRIPTED}:ScriptedExecutor",
                          scheduling_policy=PRICED_CONTINUUM_PATH,
                          policy_options={"prefill_profile": str(profile)},
                          settings=ServerSettings(served_model_name="weights-only"))
    yield server
    server.stop()


def test_without_a_tokenizer_the_config_names_the_directory_and_the_flag(weights_only):
    with pytest.raises(ValueError, match="--tokenizer") as raised:
        EngineArgs(model=str(weights_only), load_format="dummy").to_engine_config()
    assert str(weights_only) in str(raised.value)
    assert "sentencepiece" not in str(raised.value)


def test_continuum_serve_refuses_to_start_without_a_tokenizer(weights_only):
    result = subprocess.run(
        [sys.executable, "-m", "engine.cli", "serve", "--model", str(weights_only),
         "--load-format", "dummy", "--port", "0"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert str(weights_only) in result.stderr
    assert "--tokenizer" in result.stderr
    assert "sentencepiece" not in result.stderr


def test_the_flag_reaches_the_engine_config(weights_only):
    args = build_parser(["serve"]).parse_args(
        ["serve", "--model", str(weights_only), "--tokenizer", str(TINY_MODEL_DIR)])
    config = EngineArgs.from_cli_args(args).to_engine_config()
    assert config.model.tokenizer == str(TINY_MODEL_DIR)
    assert EngineArgs.cli_flags(args)[:4] == ["--model", str(weights_only),
                                              "--tokenizer", str(TINY_MODEL_DIR)]


def test_a_tokenizer_directory_that_does_not_exist_is_refused(weights_only, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        EngineArgs(model=str(weights_only), tokenizer=str(tmp_path / "nowhere")).to_engine_config()
    with pytest.raises(ValueError, match="no tokenizer files"):
        tokenizer_dir("tiny", str(tmp_path))


def test_the_loaders_read_the_tokenizer_directory(weights_only):
    with pytest.raises(ValueError, match="--tokenizer"):
        load_tokenizer(str(weights_only))
    assert load_decoder(str(weights_only)) is None
    tokenizer = load_tokenizer(str(weights_only), str(TINY_MODEL_DIR))
    decode = load_decoder(str(weights_only), "tiny")
    assert decode is not None
    ids = tokenizer("hello <tool_call>", add_special_tokens=False).input_ids
    assert decode(ids) == "hello <tool_call>"


def test_serving_with_a_separate_tokenizer(served):
    client = served.client()
    chat = client.chat.completions.create(
        model="weights-only", messages=[{"role": "user", "content": "hi"}], max_tokens=200,
        tools=[{"type": "function", "function": {"name": "bash"}}])
    (call,) = chat.choices[0].message.tool_calls  # the chat template came from DIR as well
    assert call.function.name == "bash"
    completion = client.completions.create(
        model="weights-only", prompt="Fix the bug.", max_tokens=200,
        extra_body={"job_id": "agent-1"})
    assert completion.choices[0].text.startswith("Let me look.")
    with served.http() as http:
        state = http.get("/v1/jobs/agent-1").json()
    # The engine core decoded the turn's output with the tokenizer of DIR to find its tool.
    assert state["policy"]["last_tool_name"] == "bash"
    assert state["pin"]["ttl_s"] == pytest.approx(math.log(4.0))
