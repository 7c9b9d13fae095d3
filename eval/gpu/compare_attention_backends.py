"""Greedy tokens of one model under each attention backend, compared; exit status 1 if any
backend's tokens differ from the first's.

Without a GPU the triton backend's kernels run in Triton's interpreter (set here), which is
slow: minutes for SmolLM2-135M's 30 layers. Usage:
    .venv/bin/python eval/gpu/compare_attention_backends.py --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import os
import sys
import time

PROMPTS = ("The capital of France is", "The capital of France is a city where",
           "def add(a, b):")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--backends", nargs="+", default=["sdpa", "triton"])
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined
    from engine.frontend.llm import LLM
    from engine.sampling_params import SamplingParams

    tokens = {}
    for backend in args.backends:
        started_s = time.perf_counter()
        llm = LLM(args.model, attention_backend=backend, max_model_len=512,
                  max_num_batched_tokens=256, scheduling_policy="fcfs")
        outputs = llm.generate(list(PROMPTS), SamplingParams(max_tokens=args.max_tokens,
                                                             temperature=0), use_tqdm=False)
        tokens[backend] = [list(output.outputs[0].token_ids) for output in outputs]
        texts = [output.outputs[0].text for output in outputs]
        print(f"{backend}: {time.perf_counter() - started_s:.1f} s {texts}")
    first = tokens[args.backends[0]]
    same = all(other == first for other in tokens.values())
    print("identical greedy tokens" if same else "the backends' greedy tokens differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
