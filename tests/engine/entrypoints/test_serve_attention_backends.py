"""`continuum serve --attention-backend triton --layer-kernels triton` (what runs on CUDA)
against sdpa with torch's layer ops, over HTTP with the openai SDK.

Without a GPU the Triton kernels run under Triton's interpreter (the suite's conftest sets
`TRITON_INTERPRET=1`, which the servers inherit): the same greedy tokens, with prefix-cache
hits, through prefill, chunked extend over cached blocks and decode on static buffers.
"""

from __future__ import annotations

import pytest
from openai import OpenAI

from eval.server_process import ServerProcess, ServerSpec

pytest.importorskip("triton")

SYSTEM = "You are a careful agent. Use the tools you are given and answer briefly."
QUESTIONS = ("List the files here.", "Run the tests.")


def greedy_turns(backend: str, layer_kernels: str) -> list[tuple[str, int]]:
    """(text, cached prompt tokens) of each question after the shared system prompt."""
    server = ServerProcess(ServerSpec(serve_args=(
        # fcfs: the continuum policy's start-up prefill profile is slow under the interpreter.
        "--attention-backend", backend, "--layer-kernels", layer_kernels,
        "--scheduling-policy", "fcfs", "--num-kv-blocks", "256",
        "--max-model-len", "256", "--max-num-batched-tokens", "64"))).start()
    try:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        turns = []
        for question in QUESTIONS:
            reply = client.chat.completions.create(
                model="tiny", temperature=0.0, max_tokens=8,
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": question}],
                extra_body={"ignore_eos": True})
            details = reply.usage.prompt_tokens_details
            turns.append((reply.choices[0].message.content,
                          details.cached_tokens if details else 0))
        return turns
    finally:
        log = server.log_text()
        assert server.stop() == 0, log


def test_triton_backend_serves_the_same_greedy_tokens_as_sdpa() -> None:
    triton_turns = greedy_turns("triton", "triton")
    assert triton_turns == greedy_turns("sdpa", "torch")
    assert all(cached > 0 for _, cached in triton_turns[1:])
