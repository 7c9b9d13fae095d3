"""`python -m lab structured`: the cost of structured outputs.

1. **Step cost.** `--batch-size` requests decode `--output-len` tokens each, in one batch, once
   unconstrained (EOS ignored) and once under a JSON schema whose string field cannot close
   within `--output-len` tokens, so both runs sample the same number of tokens in the same
   number of steps and differ only by the grammar (masks computed by the core, applied by the
   sampler). The two alternate `--repeats` times in one process after a warm-up; reported: the
   median wall time per step of each, their ratio, and the core's mask time per step.
2. **Compile time** of a typical agent tool set (an editor, a shell and a submit tool, as in
   SWE-agent) as one `tool_choice="required"` grammar: the frontend's check and the core's
   compile (matcher plus first mask), median of `--repeats` cold compiles, with the model's
   tokenizer and with a `--bpe-vocab-size` byte-level BPE vocabulary trained on the shipped
   workloads' text (the embedded model's vocabulary has only 272 tokens, and mask cost grows
   with the vocabulary).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from engine.engine_args import EngineArgs
from eval.report import emit
from lab.flags import add_settings_flags, bench_setting

STRING_SCHEMA = {"type": "object", "properties": {"notes": {"type": "string", "minLength": 4096}},
                 "required": ["notes"]}
AGENT_TOOLS = [
    ("str_replace_editor", {"type": "object", "properties": {
        "command": {"enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
        "path": {"type": "string"}, "file_text": {"type": "string"},
        "old_str": {"type": "string"}, "new_str": {"type": "string"},
        "insert_line": {"type": "integer"},
        "view_range": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}},
        "required": ["command", "path"], "additionalProperties": False}),
    ("bash", {"type": "object", "properties": {"command": {"type": "string"}},
              "required": ["command"], "additionalProperties": False}),
    ("submit", {"type": "object", "properties": {}, "additionalProperties": False}),
]


@dataclass(frozen=True)
class StructuredSettings:
    """The batch the step costs are measured on, and the compile times' tokenizer; read from
    the parsed flags by name."""

    batch_size: int = bench_setting(32, "requests of the measured batch")
    output_len: int = bench_setting(64, "tokens each request generates")
    prompt_len: int = bench_setting(64, "tokens of each prompt")
    repeats: int = bench_setting(5, "timed runs after one warm-up run")
    bpe_vocab_size: int = bench_setting(
        32000, "vocabulary asked of the trained tokenizer for compile times (it stops "
        "earlier when the text runs out; 0: skip)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_flags(parser, StructuredSettings)
    parser.add_argument("--json", dest="json_path", default=None, help="write results here")
    EngineArgs.add_cli_args(parser)


def main(args: argparse.Namespace) -> int:
    results = {**step_cost(args), **compile_cost(args)}
    emit(f"structured outputs, {args.model}, batch {args.batch_size}", results,
         args.json_path)
    return 0


def step_cost(args: argparse.Namespace) -> dict[str, Any]:
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams
    from engine.structured_output import grammars
    from engine.structured_output.spec import StructuredOutputSpec

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**{**vars(engine_args),
                 "max_num_seqs": max(args.batch_size, engine_args.max_num_seqs)})
    spec = StructuredOutputSpec(kind="json_schema",
                                grammar=grammars.json_schema_grammar(STRING_SCHEMA))
    prompts = [[(7 * row + column) % 256 for column in range(args.prompt_len)]
               for row in range(args.batch_size)]
    runs = {
        "free": [SamplingParams(max_tokens=args.output_len, ignore_eos=True, seed=row)
                 for row in range(args.batch_size)],
        "json": [SamplingParams(max_tokens=args.output_len, seed=row, structured_output=spec)
                 for row in range(args.batch_size)],
    }
    per_step_s: dict[str, list[float]] = {name: [] for name in runs}
    mask_s: list[float] = []
    for repeat in range(args.repeats + 1):
        for name, params in runs.items():
            before = llm.engine.get_stats()
            started_s = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall_s = time.perf_counter() - started_s
            after = llm.engine.get_stats()
            num_steps = after.num_steps - before.num_steps
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
            if repeat == 0:
                continue  # warm-up
            per_step_s[name].append(wall_s / num_steps)
            if name == "json":
                mask_s.append((after.grammar_mask_time_s - before.grammar_mask_time_s)
                              / num_steps)
    llm.shutdown()
    free, constrained = (statistics.median(per_step_s[name]) for name in runs)
    return {
        "free_step_ms": free * 1e3,
        "json_step_ms": constrained * 1e3,
        "json_over_free": constrained / free,
        "mask_ms_per_step": statistics.median(mask_s) * 1e3,
    }


def compile_cost(args: argparse.Namespace) -> dict[str, Any]:
    from engine.model.tokenizer import load_tokenizer

    results = _compile_times("model", load_tokenizer(args.model), args.repeats)
    if args.bpe_vocab_size:
        results |= _compile_times("bpe", _trained_tokenizer(args.bpe_vocab_size),
                                  args.repeats)
    return results


def _compile_times(label: str, hf_tokenizer: Any, repeats: int) -> dict[str, Any]:
    import llguidance.hf

    from engine.structured_output import grammars
    from engine.structured_output.grammars import ToolCallFormat, ToolSchema
    from engine.structured_output.output_manager import compile_grammar

    tools = [ToolSchema(name, parameters) for name, parameters in AGENT_TOOLS]
    grammar = grammars.tool_calls_grammar(tools, ToolCallFormat("hermes", False),
                                          parallel=False)
    started_s = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer)
    tokenizer_s = time.perf_counter() - started_s
    check_s = _median_time(lambda: grammars.check_grammar(grammar, tokenizer), repeats)
    compile_s = _median_time(lambda: compile_grammar(tokenizer, grammar), repeats)
    return {f"{label}_vocab": tokenizer.vocab_size,
            f"{label}_tokenizer_setup_ms": tokenizer_s * 1e3,
            f"{label}_tool_grammar_check_ms": check_s * 1e3,
            f"{label}_tool_grammar_compile_ms": compile_s * 1e3}


def _median_time(run: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started_s = time.perf_counter()
        run()
        times.append(time.perf_counter() - started_s)
    return statistics.median(times)


def _trained_tokenizer(vocab_size: int) -> Any:
    """A byte-level BPE tokenizer trained on the shipped workloads' text."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(_workload_texts(), vocab_size=vocab_size,
                            special_tokens=["<|endoftext|>", "<tool_call>", "</tool_call>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


def _workload_texts() -> Iterator[str]:
    from eval.workloads import WORKLOAD_DIR

    for path in sorted(WORKLOAD_DIR.glob("*.jsonl")):
        with path.open() as lines:
            for line in lines:
                yield json.dumps(json.loads(line))
