"""A slice of real SWE-agent jobs under memory pressure: pins save recomputation."""

from __future__ import annotations

from continuum.presets import CONTINUUM
from engine.scheduler.policies import FCFSPolicy
from tests.continuum.workload import TEST_DATA, load_trace_jobs, replay

# The first 16 jobs of the shipped `swe` workload, 12 turns (tests/data/README.md).
TRACE = TEST_DATA / "minisweagent_deepseek_slice.jsonl"


def test_continuum_recomputes_fewer_prompt_tokens_than_fcfs_on_swe_jobs() -> None:
    # 16 jobs of 12 turns, token counts scaled by 1/16, arriving 0.1 s apart: their contexts
    # need about 2.5x the 600 blocks of 4 tokens. A step costs 20 ms plus 1 ms per token.
    jobs = load_trace_jobs(TRACE, num_jobs=16, max_turns=12, token_scale=1 / 16,
                           arrival_gap_s=0.1)
    results = {
        name: replay(jobs, policy, num_blocks=600, step_s=lambda n: 0.02 + 1e-3 * n)
        for name, policy in [("fcfs", FCFSPolicy()), ("continuum", CONTINUUM.build())]
    }
    fcfs, pinned = results["fcfs"], results["continuum"]
    assert len(fcfs.job_completion_s) == len(pinned.job_completion_s) == 16
    assert fcfs.new_prompt_tokens == pinned.new_prompt_tokens
    assert pinned.num_pins_created > 0 and fcfs.num_pins_created == 0
    assert pinned.recomputed_prompt_tokens < 0.75 * fcfs.recomputed_prompt_tokens, (
        pinned.recomputed_prompt_tokens, fcfs.recomputed_prompt_tokens,
    )
