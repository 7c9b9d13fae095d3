"""The floors of issue 35's targets on each card `eval.gpu_floors` knows: no engine beats them.

For Llama-3.1-8B's shapes (or `--config`): decode steps at batch 1, 32 and 128 over 1k
contexts and at batch 32 over 8k, a 2,048-token prefill, and the offline run of `bench
throughput`'s 256 requests (prompts 128-1,024 tokens, outputs 64-512, its default seed), in
bf16, with an fp8 KV cache, and with fp8 projections as well. Prints a markdown table; no
GPU needed.

Usage: python eval/gpu/floors.py [--config FILE] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from eval.bench.throughput import make_workload
from eval.gpu_floors import CARDS, Floor, ModelShape, Precision, counts_of, run_floor, step_floor

_CONFIG = Path(__file__).resolve().parents[2] / "engine/model/configs/llama3.1-8b.json"
_PRECISIONS = {"bf16": Precision(), "fp8 KV cache": Precision.of_run("none", "fp8"),
               "fp8 KV cache and projections": Precision.of_run("fp8", "fp8")}
# (label, unit, the step's sequences or None for the offline run, the target)
_TARGETS = (
    ("decode, batch 1, 1k", "ms", [(1, 1024)], "<= 6.5 ms"),
    ("decode, batch 32, 1k", "ms", [(1, 1024)] * 32, "<= 9 ms"),
    ("decode, batch 128, 1k", "ms", [(1, 1024)] * 128, "<= 14 ms"),
    ("decode, batch 32, 8k", "ms", [(1, 8192)] * 32, "<= 14 ms"),
    ("prefill, 2,048 tokens", "tokens/s", [(2048, 0)], ">= 40,000 tokens/s"),
    ("offline, 256 requests", "output tokens/s", None, ">= 10,000 tokens/s"),
)


def floors(config: Path) -> list[dict[str, object]]:
    """Each target's floor on each card and precision, in its unit."""
    model = ModelShape.from_file(config)
    workload = make_workload(argparse.Namespace(num_requests=256, prompt_len=(128, 1024),
                                                output_len=(64, 512), workload_seed=0))
    counts = counts_of([len(request.prompt_token_ids) for request in workload],
                       [request.output_len for request in workload])
    rows = []
    for label, unit, sequences, target in _TARGETS:
        for card_name, card in CARDS.items():
            for precision_name, precision in _PRECISIONS.items():
                if sequences is None:
                    floor = run_floor(model, card, precision, counts)
                    value = counts.output_tokens / floor.lower_s
                else:
                    floor = step_floor(model, card, precision, sequences)
                    value = _in_unit(floor, unit, sequences)
                rows.append({"target": label, "goal": target, "card": card_name,
                             "precision": precision_name, "unit": unit, "floor": value,
                             "bound_by": "memory" if floor.memory_s >= floor.compute_s
                             else "compute"})
    return rows


def _in_unit(floor: Floor, unit: str, sequences: list[tuple[int, int]]) -> float:
    """A step's floor in milliseconds, or as the new tokens a second it allows."""
    if unit == "ms":
        return floor.lower_s * 1e3
    return sum(query for query, _ in sequences) / floor.lower_s


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=_CONFIG)
    parser.add_argument("--json", dest="json_path", type=Path)
    args = parser.parse_args()
    rows = floors(args.config)
    print(f"Floors of {args.config.name} (lower bounds: bytes at the bandwidth or FLOPs at the"
          " peak, whichever is longer)\n")
    print("| target | goal | card | precision | floor | bound by |")
    print("|---|---|---|---|---:|---|")
    for row in rows:
        value = f"{row['floor']:.2f}" if row["unit"] == "ms" else f"{row['floor']:,.0f}"
        print(f"| {row['target']} | {row['goal']} | {row['card']} | {row['precision']} | "
              f"{value} {row['unit']} | {row['bound_by']} |")
    if args.json_path:
        args.json_path.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
