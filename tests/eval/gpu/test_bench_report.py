"""`eval/gpu/bench_report.py` merges the raw results of `scripts/gpu_bench.sh`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _raw(tmp_path: Path, device: str, files: dict[str, object]) -> Path:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "environment.json").write_text(json.dumps({
        "device": device, "torch": "2.11.0", "triton": "3.6.0",
        "config": str(REPO / "engine/model/configs/llama3.1-8b.json"), "mode": "quick"}))
    (raw / "status.tsv").write_text("".join(f"{name}\t0\t30\n" for name in files))
    for name, content in files.items():
        (raw / f"{name}.json").write_text(json.dumps(content))
    return raw


def _summary(tmp_path: Path, raw: Path) -> str:
    subprocess.run([sys.executable, "eval/gpu/bench_report.py", str(raw), str(tmp_path)],
                   cwd=REPO, capture_output=True, text=True, check=True)
    return (tmp_path / "summary.md").read_text()



def test_report_tables_the_steps_that_ran_and_names_the_failed(tmp_path: Path) -> None:
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "environment.json").write_text(json.dumps({
        "device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0",
        "config": "engine/model/configs/llama3.1-8b.json", "mode": "quick"}))
    (raw / "status.tsv").write_text("forward-sdpa\t0\t61\nthroughput-triton\t1\t12\n"
                                    "forward-triton-eager\t124\t300\nthroughput-sdpa\t125\t0\n")
    (raw / "forward-sdpa.json").write_text(json.dumps({"results": [
        {"label": "decode, batch 1, context 1,024", "step_ms": 21.3, "tokens_per_s": 47.0,
         "error": None},
        {"label": "decode, batch 32, context 8,192", "step_ms": None, "tokens_per_s": None,
         "error": "CUDA out of memory"},
        {"label": "prefill 1 x 2,048", "step_ms": 52.5, "tokens_per_s": 39_013.0,
         "error": None, "profile": {
             "launches_per_step": 326.0, "graph_launches_per_step": 0.0,
             "device_ms_per_step": 48.81, "host_ms_per_step": 53.9,
             "idle": {"before_first_ms": 1.2, "between_ms": 0.4, "after_last_ms": 2.05}}}]}))
    result = subprocess.run([sys.executable, "eval/gpu/bench_report.py", str(raw),
                             str(tmp_path)], cwd=REPO, capture_output=True, text=True, check=True)
    summary = (tmp_path / "summary.md").read_text()
    assert summary == result.stdout.removesuffix("\n")
    assert summary.startswith("# GPU benchmark: NVIDIA H100 80GB HBM3\n")
    assert "| decode, batch 1, context 1,024 | 21.30 | 47 |" in summary
    assert "| decode, batch 32, context 8,192 | CUDA out of memory |  |" in summary
    assert ("| sdpa | prefill 1 x 2,048 | 326 | 0 | 48.81 | 53.90 | 1.20 / 0.40 / 2.05 |"
            in summary)
    assert "- throughput-triton: FAILED (exit 1; raw/throughput-triton.log), 12 s" in summary
    assert ("- forward-triton-eager: STOPPED at the time budget "
            "(raw/forward-triton-eager.log), 300 s") in summary
    assert "- throughput-sdpa: SKIPPED (the time budget was spent), 0 s" in summary
    merged = json.loads((tmp_path / "results.json").read_text())
    assert list(merged["forward"]) == ["sdpa"] and merged["throughput"] == {}


def test_report_tables_the_slowest_throughput_steps(tmp_path: Path) -> None:
    raw = _raw(tmp_path, "NVIDIA H100 80GB HBM3", {"throughput-triton-256": {
        "output_tokens": 73_000, "wall_s": 11.5, "tokens_per_s": 6_347.8, "num_steps": 571,
        "slow_steps": [{"index": 3, "wall_ms": 465.2, "num_running": 200, "num_waiting": 56,
                        "allocator": {"device_frees": 2}},
                       {"index": 9, "wall_ms": 90.4, "num_running": 210, "num_waiting": 40,
                        "allocator": {}}],
        "allocator_steps": {"num_steps": 1, "wall_s": 0.4652}}})
    summary = _summary(tmp_path, raw)
    assert "| triton-256 | 73,000 | 11.50 | 6,348 | 571 | 20.1 | 465, 90 | 1 (0.47) |" \
        in summary
    assert "The slowest steps" not in summary  # recorded without where their time went


def test_report_says_where_the_slowest_steps_spent_their_time(tmp_path: Path) -> None:
    raw = _raw(tmp_path, "NVIDIA H200", {"throughput-triton-256": {
        "output_tokens": 74_948, "wall_s": 7.75, "tokens_per_s": 9_671.0, "num_steps": 574,
        "slow_steps": [
            {"index": 444, "wall_ms": 210.7, "num_running": 61, "num_waiting": 0,
             "allocator": {}, "submit_ms": 3.5, "wait_ms": 7.0,
             "gc_collections": [1, 1, 1], "gc_ms": 195.4, "triton_compiles": []},
            {"index": 15, "wall_ms": 110.6, "num_running": 62, "num_waiting": 194,
             "allocator": {}, "submit_ms": 98.0, "wait_ms": 9.0,
             "gc_collections": [0, 0, 0], "gc_ms": 0.0,
             "triton_compiles": ["_prefill_kernel (412 ms)",
                                 "_prefill_reduce_kernel (from the disk cache)"]},
            {"index": 16, "wall_ms": 60.0, "num_running": 62, "num_waiting": 190,
             "allocator": {}, "submit_ms": 50.0, "wait_ms": 9.0,
             "gc_collections": [0, 0, 0], "gc_ms": 0.0, "triton_compiles": None}]}})
    summary = _summary(tmp_path, raw)
    assert "| triton-256 | 444 | 61 / 0 | 210.7 | 3.5 | 7.0 | 200.2 | 1 (195.4) | - |" in summary
    assert ("| triton-256 | 15 | 62 / 194 | 110.6 | 98.0 | 9.0 | 3.6 | 0 (0.0) | "
            "_prefill_kernel (412 ms), _prefill_reduce_kernel (from the disk cache) |") in summary
    assert "| triton-256 | 16 | 62 / 190 | 60.0 | 50.0 | 9.0 | 1.0 | 0 (0.0) | not recorded |" \
        in summary

_FORWARD = {"model": "llama3.1-8b", "quantization": "none", "kv_cache_dtype": "bfloat16",
            "results": [
                {"kind": "decode", "batch_size": 32, "seq_len": 8192, "context_len": 0,
                 "label": "decode, batch 32, context 8,192", "step_ms": 18.04,
                 "tokens_per_s": 1_774.0, "error": None, "profile": None},
                {"kind": "prefill", "batch_size": 1, "seq_len": 2048, "context_len": 0,
                 "label": "prefill 1 x 2,048", "step_ms": 51.7, "tokens_per_s": 39_619.0,
                 "error": None, "profile": None}]}
_THROUGHPUT = {"output_tokens": 74_948, "wall_s": 10.08, "tokens_per_s": 7_436.0,
               "num_steps": 574, "quantization": "none", "kv_cache_dtype": "auto",
               "workload": {"prompt_tokens": 144_138, "prompt_attention_pairs": 48_391_154,
                            "decode_tokens": 74_692, "decode_context_tokens": 55_434_654,
                            "min_decode_steps": 510, "num_requests": 256}}


def test_report_sets_each_figure_against_the_cards_floor(tmp_path: Path) -> None:
    raw = _raw(tmp_path, "NVIDIA H100 80GB HBM3",
               {"forward-triton": _FORWARD, "throughput-triton-256": _THROUGHPUT})
    summary = _summary(tmp_path, raw)
    assert "## Against the NVIDIA H100 SXM 80GB's floor" in summary
    # 18.04 ms over the 14.74 ms bandwidth floor; 39,619 tokens/s against 68,252.
    assert "| decode, batch 32, context 8,192 | 1.22x |" in summary
    assert "| prefill 1 x 2,048 | 1.72x |" in summary
    assert "| triton-256 | 7,436 | 16,838 | 2.26x |" in summary


def test_report_has_no_floors_on_a_card_without_figures(tmp_path: Path) -> None:
    raw = _raw(tmp_path, "NVIDIA A100-SXM4-80GB", {"forward-triton": _FORWARD})
    assert "floor" not in _summary(tmp_path, raw)


def test_report_of_unreadable_floors_still_writes_the_rest(tmp_path: Path) -> None:
    broken = {**_THROUGHPUT, "workload": {"prompt_tokens": 1}}
    raw = _raw(tmp_path, "NVIDIA H100 80GB HBM3", {"throughput-triton-256": broken})
    summary = _summary(tmp_path, raw)
    assert "(No floors: TypeError" in summary
    assert "| triton-256 | 74,948 | 10.08 | 7,436 | 574 |" in summary


def test_report_without_the_repository_on_the_path_still_writes_the_rest(
        tmp_path: Path) -> None:
    raw = _raw(tmp_path, "NVIDIA H100 80GB HBM3", {"throughput-triton-256": _THROUGHPUT})
    # -S: no site-packages, so no installed copy of the repository either.
    subprocess.run([sys.executable, "-S", "eval/gpu/bench_report.py", str(raw),
                    str(tmp_path)], cwd=REPO, capture_output=True, text=True, check=True,
                   env={"PATH": "/usr/bin:/bin"})
    summary = (tmp_path / "summary.md").read_text()
    assert "(No floors: `eval.gpu_floors` is not importable" in summary
    assert "| triton-256 | 74,948 | 10.08 | 7,436 | 574 |" in summary
