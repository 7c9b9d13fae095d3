"""`python -m lab forward`: shapes driven through the model runner on the tiny model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.model.tiny import TINY_MODEL_DIR
from engine.outputs import PendingStep
from engine.scheduler.output import SchedulerOutput
from engine.worker.model_runner import ModelRunner
from lab.bench.forward import (
    SAMPLINGS,
    SamplingName,
    Shape,
    _engine_config,
    _PrefillRun,
    _Sequences,
    _step_together,
)
from lab.cli import main


def test_tiny_config_writes_a_sane_report(tmp_path: Path) -> None:
    json_path, table_path = tmp_path / "forward.json", tmp_path / "forward.md"
    code = main(["forward", "--config", str(TINY_MODEL_DIR / "config.json"),
                 "--decode", "1x40", "3x20", "--prefill", "2x24", "--extend", "2x6@30",
                 "1x5@20+3x12",
                 "--decode-steps", "3",
                 "--repeats", "2", "--max-num-batched-tokens", "16", "--async-scheduling",
                 "--json", str(json_path), "--markdown", str(table_path)])
    assert code == 0
    report = json.loads(json_path.read_text())
    assert report["async_scheduling"] is True
    assert report["model"] == "tiny" and report["device"] == "cpu"
    assert report["dtype"] == "float32" and report["torch"] and report["triton"]
    assert report["attention_backend"] == "sdpa" and report["cuda_graphs"] is False  # auto
    results = report["results"]
    assert [(r["kind"], r["batch_size"], r["seq_len"]) for r in results] == [
        ("decode", 1, 40), ("decode", 3, 20), ("prefill", 2, 24), ("extend", 2, 6),
        ("extend", 1, 5)]
    assert results[-2]["context_len"] == 30
    assert (results[-1]["decodes_beside"], results[-1]["decode_context_len"]) == (3, 12)
    for result in results:
        assert result["error"] is None and result["step_ms"] > 0
        num_tokens = result["batch_size"] * (1 if result["kind"] == "decode" else result["seq_len"])
        num_tokens += result["decodes_beside"]
        assert result["tokens_per_s"] == pytest.approx(num_tokens / result["step_ms"] * 1e3)
    table = table_path.read_text()
    assert "| decode, batch 3, context 20 |" in table and "| prefill 2 x 24 |" in table
    assert "| extend 2 x 6 over 30 cached |" in table
    assert "| extend 1 x 5 over 20 cached, beside 3 decodes at 12 |" in table


def test_sequences_follow_the_runner_through_chunked_prefill_and_decode() -> None:
    runner = ModelRunner(EngineConfig(
        model=ModelConfig(model="tiny"), cache=CacheConfig(block_size=4, num_kv_blocks=32),
        scheduler=SchedulerConfig(max_model_len=40, max_num_batched_tokens=16, max_num_seqs=3)))
    sequences = _Sequences(runner, "s", Shape("decode", 3, 10), blocks_per_seq=10,
                           rng=np.random.default_rng(0))
    assert sequences.prefill(token_budget=7) > 0  # 30 prompt tokens: 5 steps
    assert sequences.step_id == 5
    sequences.decode(num_steps=4)
    batch = runner.batch
    rows = [batch.row_of[req_id] for req_id in sequences.prompts]
    assert batch.num_computed_tokens[rows].tolist() == [13, 13, 13]
    assert batch.num_tokens[rows].tolist() == [15, 15, 15]  # prompt + one sampled per step
    for req_id, row in zip(sequences.prompts, rows, strict=True):
        assert batch.token_ids[row, :10].tolist() == sequences.prompts[req_id]
    sequences.finish()
    assert batch.num_reqs == 0


@pytest.mark.parametrize("sampling", ["grammar", "penalties", "nucleus"])
def test_sequences_sample_as_their_shape_asks(sampling: SamplingName) -> None:
    """Under `grammar` each request samples only its bitmask's tokens (the chunked prefill's
    partial steps, which sample nothing, send no row for it: the runner would refuse one)."""
    runner = ModelRunner(EngineConfig(
        model=ModelConfig(model="tiny"), cache=CacheConfig(block_size=4, num_kv_blocks=32),
        scheduler=SchedulerConfig(max_model_len=40, max_num_batched_tokens=16, max_num_seqs=3)))
    sequences = _Sequences(runner, "s", Shape("decode", 3, 10, sampling=sampling),
                           blocks_per_seq=10, rng=np.random.default_rng(0))
    sequences.prefill(token_budget=7)
    sequences.decode(num_steps=4)
    batch = runner.batch
    for index, req_id in enumerate(sequences.prompts):
        row = batch.row_of[req_id]
        assert batch.rows[row].sampling_params == SAMPLINGS[sampling]
        if sampling == "grammar":
            assert sequences.grammar_words is not None
            words = sequences.grammar_words[index]
            assert all(int(words[token // 32]) >> (token % 32) & 1
                       for token in batch.token_ids[row, 10:15].tolist())
    sequences.finish()


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_pipelined_decode_steps_sample_what_steps_in_order_sample(backend: str) -> None:
    """`--async-scheduling`: each step is launched before the last one's tokens are read (its
    inputs come from the device: the static decode buffers' with triton); the runner's rows
    end with the same tokens."""
    token_ids = []
    for pipelined in (False, True):
        runner = ModelRunner(EngineConfig(
            model=ModelConfig(model="tiny", attention_backend=backend),
            cache=CacheConfig(block_size=8, num_kv_blocks=16),
            scheduler=SchedulerConfig(max_model_len=40, max_num_batched_tokens=16,
                                      max_num_seqs=3)))
        sequences = _Sequences(runner, "s", Shape("decode", 3, 10), blocks_per_seq=5,
                               rng=np.random.default_rng(0))
        sequences.prefill(token_budget=16)
        sequences.decode(num_steps=6, pipelined=pipelined)
        batch = runner.batch
        rows = [batch.row_of[req_id] for req_id in sequences.prompts]
        assert batch.num_tokens[rows].tolist() == [17, 17, 17]
        token_ids.append(batch.token_ids[rows, :17].tolist())
    assert token_ids[0] == token_ids[1]


def test_shapes_are_parsed_or_refused() -> None:
    assert Shape.parse("decode", "32x1024") == Shape("decode", 32, 1024)
    assert Shape.parse("prefill", "1x2048").label == "prefill 1 x 2,048"
    assert Shape.parse("prefill", "1x2048x8") == Shape("prefill", 1, 2048, num_steps=8)
    assert Shape.parse("prefill", "1x2048x8").label == "prefill 1 x 2,048, 8 steps back to back"
    assert (Shape("decode", 32, 1024, sampling="penalties").label
            == "decode, batch 32, context 1,024, penalties sampling")
    for text in ("32", "0x8", "ax8", "4x", "4x8x2"):
        with pytest.raises(argparse.ArgumentTypeError, match="BATCHxTOKENS"):
            Shape.parse("decode", text)
    for text in ("4x8x0", "4x8x", "4x8x2x2"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"BATCHxTOKENS\[xSTEPS\]"):
            Shape.parse("prefill", text)
    assert Shape.parse("extend", "1x256@30000") == Shape("extend", 1, 256, context_len=30000)
    assert Shape.parse("extend", "1x256@30000").label == "extend 1 x 256 over 30,000 cached"
    assert Shape.parse("extend", "1x256@8000+32x1024") == Shape(
        "extend", 1, 256, context_len=8000, decodes_beside=32, decode_context_len=1024)
    assert (Shape.parse("extend", "1x256@8000+32x1024").label
            == "extend 1 x 256 over 8,000 cached, beside 32 decodes at 1,024")
    for text in ("1x256", "1x256@0", "1x256@x", "1x2x3@5", "0x8@5", "1x2@5+", "1x2@5+3",
                 "1x2@5+0x4", "1x2@5+3x0", "1x2@5+3x4x1", "1x2@5+3x4+1x1"):
        with pytest.raises(argparse.ArgumentTypeError, match="BATCHxTOKENS"):
            Shape.parse("extend", text)


def test_an_extend_turn_arrives_as_a_prefix_hit_and_samples_what_a_whole_prefill_does(
        ) -> None:
    runner = ModelRunner(EngineConfig(
        model=ModelConfig(model="tiny"), cache=CacheConfig(block_size=4, num_kv_blocks=32),
        scheduler=SchedulerConfig(max_model_len=40, max_num_batched_tokens=16, max_num_seqs=3)))
    filled = _Sequences(runner, "s", Shape("prefill", 2, 30), blocks_per_seq=8,
                        rng=np.random.default_rng(0))
    with pytest.raises(ValueError, match="up_to must leave every prompt a token"):
        filled.prefill(token_budget=16, up_to=30)
    filled.prefill(token_budget=16, up_to=24)
    with pytest.raises(ValueError, match="finish them first"):
        filled.arriving_again("t")
    filled.finish()
    turn = filled.arriving_again("t")
    assert turn.num_computed == {"t-0": 24, "t-1": 24} and turn.prompts == {
        "t-0": filled.prompts["s-0"], "t-1": filled.prompts["s-1"]}
    turn.step(dict.fromkeys(turn.prompts, 6))  # one step: the chunks over the cached 24
    batch = runner.batch
    rows = [batch.row_of[req_id] for req_id in turn.prompts]
    assert batch.num_computed_tokens[rows].tolist() == [24, 24]  # as the step began
    assert batch.num_tokens[rows].tolist() == [31, 31]  # the prompt and one sampled
    sampled = batch.token_ids[rows, 30].tolist()
    turn.finish()
    whole = _Sequences(runner, "w", Shape("prefill", 2, 30), blocks_per_seq=8,
                       rng=np.random.default_rng(0))
    whole.prefill(token_budget=16)
    rows = [batch.row_of[req_id] for req_id in whole.prompts]
    assert batch.token_ids[rows, 30].tolist() == sampled
    whole.finish()
    assert batch.num_reqs == 0


def test_a_turn_beside_decodes_is_one_step_of_both_on_blocks_of_their_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    runner = ModelRunner(EngineConfig(
        model=ModelConfig(model="tiny"), cache=CacheConfig(block_size=4, num_kv_blocks=40),
        scheduler=SchedulerConfig(max_model_len=40, max_num_batched_tokens=16, max_num_seqs=5)))
    rng = np.random.default_rng(0)
    beside = _Sequences(runner, "d", Shape("decode", 3, 10), blocks_per_seq=4, rng=rng)
    beside.prefill(token_budget=16)
    filled = _Sequences(runner, "s", Shape("prefill", 2, 30), blocks_per_seq=8, rng=rng,
                        first_block=12)
    filled.prefill(token_budget=16, up_to=24)
    filled.finish()
    turn = filled.arriving_again("t")
    assert turn.block_ids["t-0"][0] == 12 and beside.block_ids["d-2"][-1] == 11
    steps: list[SchedulerOutput] = []
    submit = runner.submit

    def spy(output: SchedulerOutput) -> PendingStep:
        steps.append(output)
        return submit(output)

    monkeypatch.setattr(runner, "submit", spy)
    assert _step_together({turn: dict.fromkeys(turn.prompts, 6),
                           beside: dict.fromkeys(beside.prompts, 1)}) > 0
    step, = steps
    assert step.num_scheduled_tokens == {"t-0": 6, "t-1": 6, "d-0": 1, "d-1": 1, "d-2": 1}
    assert step.total_num_scheduled_tokens == 15
    assert [new.req_id for new in step.scheduled_new_reqs] == ["t-0", "t-1"]
    assert step.scheduled_cached_reqs.req_ids == ["d-0", "d-1", "d-2"]
    batch = runner.batch
    assert [int(batch.num_tokens[batch.row_of[req_id]])
            for req_id in [*turn.prompts, *beside.prompts]] == [31, 31, 12, 12, 12]
    turn.finish()
    beside.finish()
    assert batch.num_reqs == 0


@pytest.mark.parametrize(("backend", "pipelined"),
                         [("sdpa", False), ("sdpa", True), ("triton", True)])
def test_prefills_back_to_back_leave_the_runner_empty(backend: str, pipelined: bool) -> None:
    """Each step's prompts are prefilled whole and sample one token; a step's requests leave
    the runner once its tokens are read, so at most two steps' requests are ever in it."""
    runner = ModelRunner(EngineConfig(
        model=ModelConfig(model="tiny", attention_backend=backend),
        cache=CacheConfig(block_size=8, num_kv_blocks=8),
        scheduler=SchedulerConfig(max_model_len=40, max_num_batched_tokens=24, max_num_seqs=4)))
    args = argparse.Namespace(block_size=8, decode_steps=1, repeats=1, profile=False)
    prefill_run = _PrefillRun(runner, "p", Shape("prefill", 2, 12, num_steps=3), args,
                              np.random.default_rng(0))
    rows_seen = []
    submit = runner.submit

    def counting_submit(scheduler_output: SchedulerOutput) -> PendingStep:
        launched = submit(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens:
            rows_seen.append(runner.batch.num_reqs)
            assert scheduler_output.total_num_scheduled_tokens == 24
        return launched

    runner.submit = counting_submit  # type: ignore[method-assign]
    assert prefill_run.run(pipelined) > 0
    # Pipelined, a step is launched beside the previous one's requests; else after they left.
    assert rows_seen == ([2, 4, 4] if pipelined else [2, 2, 2])
    last = prefill_run.steps[-1]
    rows = [runner.batch.row_of[req_id] for req_id in last.prompts]
    assert runner.batch.num_tokens[rows].tolist() == [13, 13]  # the prompt and one sampled
    prefill_run.finish()
    assert runner.batch.num_reqs == 0


@pytest.mark.parametrize("sampling", ["greedy", "grammar"])
def test_a_turn_beside_decodes_runs_on_blocks_of_its_own_and_every_step_has_both(
        sampling: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Alone in its runner (the pool sized by this shape only), profiled (the decodes gain a
    # token a warm-up, timed, profiled and sampled step), in blocks of 4 tokens.
    steps: list[tuple[SchedulerOutput, int]] = []
    submit = ModelRunner.submit

    def spy(runner: ModelRunner, output: SchedulerOutput) -> PendingStep:
        steps.append((output, runner.num_kv_blocks))
        return submit(runner, output)

    monkeypatch.setattr(ModelRunner, "submit", spy)
    json_path = tmp_path / "forward.json"
    assert main(["forward", "--decode", "--prefill", "--extend", "1x4@20+2x10",
                 "--block-size", "4", "--max-num-batched-tokens", "4", "--repeats", "2",
                 "--profile", "--sampling", sampling, "--json", str(json_path)]) == 0
    result, = json.loads(json_path.read_text())["results"]
    assert result["error"] is None
    blocks: dict[str, set[int]] = {}
    for output, num_kv_blocks in steps:
        for new in output.scheduled_new_reqs:
            assert max(new.block_ids) < num_kv_blocks
            blocks.setdefault(new.req_id.split("-")[0], set()).update(new.block_ids)
    decode_blocks = blocks.pop("beside")
    assert all(not decode_blocks & turn_blocks for turn_blocks in blocks.values())
    turns = [output for output, _ in steps if any(
        req_id.startswith("extend") and not req_id.startswith("extend-")
        for req_id in output.num_scheduled_tokens)]
    assert len(turns) == 1 + 2 + 1 + 4  # warm-up, timed, profiled and sampled
    for output in turns:
        assert output.num_scheduled_tokens["beside-0"] == 1
        assert output.num_scheduled_tokens["beside-1"] == 1
        assert output.total_num_scheduled_tokens == 6
        if sampling == "grammar":
            assert output.grammar_bitmask is not None
            assert len(output.grammar_bitmask.req_ids) == 3  # the turn's and both decodes'


def test_a_turn_beside_decodes_counts_them_in_the_step_budget() -> None:
    args = argparse.Namespace(block_size=4, decode_steps=1, repeats=1, profile=False,
                              max_num_batched_tokens=4, dtype="auto", seed=0, device="cpu",
                              attention_backend="auto", layer_kernels="auto",
                              enforce_eager=False, quantization="none",
                              kv_cache_dtype="auto")
    config = _engine_config(args, "tiny", [Shape.parse("extend", "1x4@20+3x10")])
    assert config.scheduler.max_num_batched_tokens == 7
    assert config.scheduler.max_num_seqs == 4


def test_prefills_back_to_back_are_a_shape_of_their_own(tmp_path: Path) -> None:
    json_path, table_path = tmp_path / "forward.json", tmp_path / "forward.md"
    assert main(["forward", "--decode", "--prefill", "2x12", "2x12x3", "--repeats", "1",
                 "--async-scheduling", "--json", str(json_path),
                 "--markdown", str(table_path)]) == 0
    one, stream = json.loads(json_path.read_text())["results"]
    assert (one["num_steps"], stream["num_steps"]) == (1, 3)
    assert stream["error"] is None
    assert stream["tokens_per_s"] == pytest.approx(3 * 24 / (3 * stream["step_ms"]) * 1e3)
    assert "| prefill 2 x 12, 3 steps back to back |" in table_path.read_text()


def test_shapes_beyond_the_model_positions_are_reported_not_run(tmp_path: Path) -> None:
    json_path = tmp_path / "forward.json"
    assert main(["forward", "--decode", "1x5000", "1x16", "--prefill",
                 "--decode-steps", "2", "--repeats", "1", "--json", str(json_path)]) == 0
    beyond, fitting = json.loads(json_path.read_text())["results"]
    assert beyond["step_ms"] is None and "positions" in beyond["error"]
    assert fitting["error"] is None and fitting["step_ms"] > 0
    with pytest.raises(ValueError, match="positions"):
        main(["forward", "--decode", "1x5000", "--prefill"])


def test_a_bad_shape_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["forward", "--prefill", "2048"])
    assert "BATCHxTOKENS" in capsys.readouterr().err


def test_profile_adds_each_shape_its_step_costs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    json_path = tmp_path / "forward.json"
    assert main(["forward", "--decode", "2x16", "--prefill", "1x8", "--decode-steps",
                 "2", "--repeats", "1", "--profile", "--json", str(json_path)]) == 0
    decode, prefill = json.loads(json_path.read_text())["results"]
    # On the CPU nothing is launched on a device; the host's time is the step's.
    assert decode["profile"]["launches_per_step"] == 0
    assert decode["profile"]["device_ms_per_step"] == 0
    assert decode["profile"]["host_ms_per_step"] > 0
    assert prefill["profile"]["launches_per_step"] == 0
    assert prefill["profile"]["host_ms_per_step"] > 0
    assert prefill["profile"]["idle"] == {"before_first_ms": 0, "between_ms": 0,
                                          "after_last_ms": 0}  # no device on the CPU
    out = capsys.readouterr().out
    assert "profile of decode, batch 2, context 16: 0.0 launches" in out
    assert "profile of prefill 1 x 8: 0.0 launches" in out
    assert "the host's time by operator:" in out
    assert "the host's Python, sampled:" in out
    # Sampled apart from the profiled run: the engine's own lines are named, with their share.
    assert "| ms | share | repository line, with what it calls |" in out
    assert "engine/worker/model_runner.py:" in out
    assert "top_host_ops" not in decode["profile"] and "host_stacks" not in decode["profile"]
