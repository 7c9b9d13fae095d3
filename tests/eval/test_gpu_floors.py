"""`eval.gpu_floors`: the bytes and FLOPs a step or an offline run cannot do without."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eval.gpu_floors import (
    CARDS,
    Card,
    ModelShape,
    Precision,
    WorkloadCounts,
    card_of,
    counts_of,
    run_floor,
    step_floor,
)

REPO = Path(__file__).resolve().parents[2]
LLAMA_8B = REPO / "engine/model/configs/llama3.1-8b.json"
# Round figures, so that each expected value below is worked by hand.
CARD = Card("test card", memory_bytes_per_s=1e12, bf16_flops_per_s=1e14,
            fp8_flops_per_s=2e14)
MODEL = ModelShape(num_layers=2, hidden_size=8, q_dim=8, layer_params=1_000,
                   head_params=100, kv_values_per_token=16)


def test_a_workloads_counts_by_hand() -> None:
    counts = counts_of([3, 5], [1, 3])
    # The second request's two decodes attend 5 + 1 and 5 + 2 keys.
    assert counts == WorkloadCounts(prompt_tokens=8, prompt_attention_pairs=6 + 15,
                                    decode_tokens=2, decode_context_tokens=13,
                                    min_decode_steps=2, num_requests=2)
    assert counts.output_tokens == 4


@pytest.mark.parametrize(("prompts", "outputs"), [([], []), ([3], [1, 2]), ([0], [1]),
                                                  ([3], [0])])
def test_counts_refuse_what_is_not_a_workload(prompts: list[int], outputs: list[int]) -> None:
    with pytest.raises(ValueError):
        counts_of(prompts, outputs)


def test_the_model_shape_counts_every_projection() -> None:
    tiny = ModelShape.from_file(REPO / "engine/model/tiny/config.json")
    # hidden 128, 4 heads and 2 KV heads of 32, intermediate 384, 4 layers, vocab 272.
    per_layer = 128 * (128 + 2 * 64) + 128 * 128 + 3 * 128 * 384
    assert tiny == ModelShape(num_layers=4, hidden_size=128, q_dim=128,
                              layer_params=4 * per_layer, head_params=272 * 128,
                              kv_values_per_token=4 * 2 * 64)
    llama = ModelShape.from_file(LLAMA_8B)
    # The 15.0 GB of bf16 weights a decode step reads (docs/benchmarks.md).
    assert (llama.layer_params + llama.head_params) * 2 == pytest.approx(15.0e9, rel=1e-3)
    assert llama.kv_values_per_token * 2 == 128 * 1024  # 128 KiB of bf16 K/V a token


def test_a_steps_floor_by_hand() -> None:
    # Two sequences: a decode after 10 cached tokens, a prompt of 4.
    floor = step_floor(MODEL, CARD, Precision(), [(1, 10), (4, 0)])
    weights = (1_000 + 100) * 2
    embedded_rows = 5 * 8 * 2
    kv = 10 * 16 * 2
    assert floor.memory_s == pytest.approx((weights + embedded_rows + kv) / 1e12)
    pairs = (10 + 1) + 4 * 5 // 2
    flops = 2 * 1_000 * 5 + 2 * 100 * 2 + 4 * pairs * 8 * 2
    assert floor.compute_s == pytest.approx(flops / 1e14)
    assert floor.lower_s == max(floor.memory_s, floor.compute_s)


def test_fp8_halves_the_bytes_and_doubles_the_projections_rate() -> None:
    bf16 = step_floor(MODEL, CARD, Precision(), [(1, 10)])
    fp8 = step_floor(MODEL, CARD, Precision.of_run("fp8", "fp8"), [(1, 10)])
    assert fp8.memory_s == pytest.approx(bf16.memory_s - (1_000 + 10 * 16) / 1e12)
    assert fp8.compute_s == pytest.approx(bf16.compute_s - 2 * 1_000 / 2e14)


@pytest.mark.parametrize(("quantization", "kv_cache_dtype", "expected"), [
    ("none", "auto", Precision()),
    ("none", "bfloat16", Precision()),
    ("none", "fp8", Precision(kv_bytes=1.0)),
    ("none", "float8_e4m3fn", Precision(kv_bytes=1.0)),
    ("fp8", "auto", Precision(weight_bytes=1.0, fp8_products=True)),
])
def test_a_runs_precision(quantization: str, kv_cache_dtype: str, expected: Precision) -> None:
    assert Precision.of_run(quantization, kv_cache_dtype) == expected


def test_an_offline_runs_floor_by_hand() -> None:
    counts = counts_of([3, 5], [1, 3])
    floor = run_floor(MODEL, CARD, Precision(), counts)
    # The two decodes attend 13 keys, 11 of them cached (each has its own new token's K/V).
    assert floor.memory_s == pytest.approx((2 * (1_000 + 100) * 2 + 11 * 16 * 2) / 1e12)
    flops = 2 * 1_000 * (8 + 2) + 2 * 100 * (2 + 2) + 4 * (21 + 13) * 8 * 2
    assert floor.compute_s == pytest.approx(flops / 1e14)


@pytest.mark.parametrize(("name", "card"), [
    ("NVIDIA H100 80GB HBM3", CARDS["h100-sxm"]), ("NVIDIA H200", CARDS["h200"]),
    ("NVIDIA H100 PCIe", None), ("NVIDIA H200 NVL", None), ("cpu", None),
    ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", None),
])
def test_cards_are_known_by_the_name_torch_gives(name: str, card: Card | None) -> None:
    assert card_of(name) == card


def test_the_8k_decode_target_is_below_an_h100s_bf16_floor() -> None:
    llama = ModelShape.from_file(LLAMA_8B)
    floor = step_floor(llama, CARDS["h100-sxm"], Precision(), [(1, 8192)] * 32)
    assert 14e-3 < floor.lower_s == floor.memory_s < 15e-3
    fp8_cache = step_floor(llama, CARDS["h100-sxm"], Precision.of_run("none", "fp8"),
                           [(1, 8192)] * 32)
    assert fp8_cache.lower_s < 10e-3


def test_the_script_tables_each_target_on_each_card(tmp_path: Path) -> None:
    out = tmp_path / "floors.json"
    result = subprocess.run([sys.executable, "eval/gpu/floors.py", "--json", str(out)],
                            cwd=REPO, capture_output=True, text=True, check=True, timeout=120)
    rows = json.loads(out.read_text())
    assert len(rows) == 6 * 2 * 3  # targets x cards x precisions
    offline = next(row for row in rows if row["target"] == "offline, 256 requests"
                   and row["card"] == "h100-sxm" and row["precision"] == "bf16")
    # 510 steps' weights and 7.26 TB of cached K/V at 3.35 TB/s: 4.45 s for 74,948 tokens.
    assert offline["floor"] == pytest.approx(74_948 / 4.451, rel=1e-3)
    assert offline["bound_by"] == "memory"
    assert "| decode, batch 32, 8k | <= 14 ms | h100-sxm | bf16 | 14.74 ms | memory |" \
        in result.stdout
