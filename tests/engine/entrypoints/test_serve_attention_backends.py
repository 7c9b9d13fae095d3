"""`continuum serve --attention-backend triton --layer-kernels triton` (what runs on CUDA)
against sdpa with torch's layer ops, over HTTP with the openai SDK.

Without a GPU the Triton kernels run under Triton's interpreter (the suite's conftest sets
`TRITON_INTERPRET=1`, which the servers inherit): the same greedy tokens, with prefix-cache
hits, through prefill, chunked extend over cached blocks and decode on static buffers.
"""

from __future__ import annotations

import pytest
from openai import OpenAI

from lab.server_process import ServerProcess, ServerSpec

pytest.importorskip("triton")

# Short (the tiny tokenizer spends a token a byte; each token costs a program of every layer
# kernel under the interpreter), yet longer than a step's 32 tokens with the chat template:
# the first prompt is prefilled in chunks, the second extends the first's cached blocks. No
# sequence reaches 128 tokens, so decode runs unsplit here (test_triton_kernels.py splits it).
SYSTEM = "You are an agent."
QUESTIONS = ("List the files.", "Run the tests.")
MAX_TOKENS = 6


def greedy_turns(backend: str, layer_kernels: str
                 ) -> list[tuple[str, int, list[list[tuple[str, float]]]]]:
    """(text, cached prompt tokens, each token's top 3 logprobs) of each question after the
    shared system prompt. The tiny model's greedy text is a few tokens repeated, which a
    wrong attention could still produce; the logprobs show the distribution itself."""
    server = ServerProcess(ServerSpec(serve_args=(
        # fcfs: the continuum policy's start-up prefill profile is slow under the interpreter.
        "--attention-backend", backend, "--layer-kernels", layer_kernels,
        "--scheduling-policy", "fcfs", "--num-kv-blocks", "256",
        "--max-model-len", "256", "--max-num-batched-tokens", "32"))).start()
    try:
        client = OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")
        turns = []
        for question in QUESTIONS:
            reply = client.chat.completions.create(
                model="tiny", temperature=0.0, max_tokens=MAX_TOKENS, logprobs=True, top_logprobs=3,
                messages=[{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": question}],
                extra_body={"ignore_eos": True})
            details = reply.usage.prompt_tokens_details
            choice = reply.choices[0]
            assert choice.logprobs is not None and choice.logprobs.content is not None
            turns.append((choice.message.content, details.cached_tokens if details else 0,
                          [[(top.token, top.logprob) for top in token.top_logprobs]
                           for token in choice.logprobs.content]))
        return turns
    finally:
        log = server.log_text()
        assert server.stop() == 0, log


def test_triton_backend_serves_the_same_greedy_tokens_as_sdpa() -> None:
    triton_turns = greedy_turns("triton", "triton")
    sdpa_turns = greedy_turns("sdpa", "torch")
    assert [turn[:2] for turn in triton_turns] == [turn[:2] for turn in sdpa_turns]
    assert all(cached > 0 for _, cached, _ in triton_turns[1:])
    for (_, _, triton_tops), (_, _, sdpa_tops) in zip(triton_turns, sdpa_turns, strict=True):
        assert len(triton_tops) == len(sdpa_tops) == MAX_TOKENS
        for triton_top, sdpa_top in zip(triton_tops, sdpa_tops, strict=True):
            assert [token for token, _ in triton_top] == [token for token, _ in sdpa_top]
            assert [value for _, value in triton_top] == pytest.approx(
                [value for _, value in sdpa_top], abs=1e-4)
