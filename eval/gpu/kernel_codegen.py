"""Compiles the triton backend's prefill kernel for a GPU that this machine need not have
(sm_90, the H100's, by default) and reports, for each tuned tile, what the code does with its
K/V loads: the asynchronous copies in the loop's code (0: loads not pipelined), the registers
a thread uses and the bytes it spills (from `ptxas -v`, which Triton's wheel ships).

The strides are given the divisibility Triton sees at run time (each divisible by 16, unit
strides specialised to 1, the block table's row stride not specialised), so the code is the
code a GPU would run. Nothing runs: it needs neither a GPU nor a CUDA driver.

Usage: python eval/gpu/kernel_codegen.py [--tiles M,N,WARPS,STAGES ...] [--head-dims 64 128]
       [--groups 1 2 4 8 16] [--dtypes bf16 fp16 bf16/fp8] [--split] [--arch 90] [--json FILE]
(default: every tile of `_TUNED_PREFILL_TILES`; a dtype `Q/KV` names the query's and the
cache's; `--split` compiles the variant that splits keys and writes float32 partials). Exits 1
if a tile spills or its loads are not pipelined.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret

import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.model.attention import triton_kernels

_TRITON_TYPES = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8e4nv"}
_UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_od")


@dataclass(frozen=True)
class TileCode:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    head_dim: int
    group_pad: int
    dtype: str
    split: bool
    async_copies: int
    registers: int | None
    spill_bytes: int | None


def compile_prefill(block_m: int, block_n: int, num_warps: int, num_stages: int, *,
                    head_dim: int, group_pad: int, dtype: str, arch: int,
                    split: bool = False) -> TileCode:
    """One tile of the prefill kernel compiled for `sm_{arch}` (`split`: its variant that
    splits keys)."""
    query_type, _, kv_type = dtype.partition("/")
    kernel = JITFunction(triton_kernels._prefill_kernel.fn)
    names = kernel.arg_names
    constexprs: dict[str, object] = {
        "NUM_KV_HEADS": 8, "GROUP": group_pad, "GROUP_PAD": group_pad,
        "BLOCK_Q": block_m // group_pad, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16,
        "BLOCK_N": block_n, "DOT_PRECISION": "ieee", "SPLIT": split,
        **dict.fromkeys(_UNIT_STRIDES, 1)}
    signature = {}
    for name in names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in ("k_cache_ptr", "v_cache_ptr"):
            signature[name] = "*" + _TRITON_TYPES[kv_type or query_type]
        elif name in ("query_ptr", "out_ptr"):
            signature[name] = "*" + _TRITON_TYPES[query_type]
        elif name.startswith("part_"):
            signature[name] = "*fp32"
        elif name.endswith("_ptr"):
            signature[name] = "*i32"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
    divisible = [name for name in names if signature[name] != "constexpr"
                 and (name.endswith("_ptr") or name.startswith("stride_"))
                 and name != "stride_bt"]
    source = ASTSource(
        fn=kernel, signature=signature,
        constexprs={(names.index(name),): value for name, value in constexprs.items()},
        attrs={(names.index(name),): [["tt.divisibility", 16]] for name in divisible})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    registers, spill_bytes = _ptxas_usage(compiled.asm["ptx"], arch)
    return TileCode(block_m, block_n, num_warps, num_stages, head_dim, group_pad, dtype, split,
                    compiled.asm["ttgir"].count("async_copy_global_to_local"),
                    registers, spill_bytes)


def _ptxas_usage(ptx: str, arch: int) -> tuple[int | None, int | None]:
    ptxas = Path(triton.backends.nvidia.__file__).parent / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "kernel.ptx"
        path.write_text(ptx)
        report = subprocess.run([str(ptxas), f"-arch=sm_{arch}a", "-v", str(path),
                                 "-o", os.devnull], capture_output=True, text=True).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    return (int(registers.group(1)) if registers else None,
            int(spills.group(1)) if spills else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", nargs="+", default=None, metavar="M,N,WARPS,STAGES")
    parser.add_argument("--head-dims", nargs="+", type=int, default=(64, 128))
    parser.add_argument("--groups", nargs="+", type=int, default=(1, 2, 4, 8, 16))
    parser.add_argument("--dtypes", nargs="+", default=("bf16", "fp16", "bf16/fp8"))
    parser.add_argument("--split", action="store_true")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    tiles = (triton_kernels._TUNED_PREFILL_TILES if args.tiles is None
             else [tuple(int(part) for part in tile.split(",")) for tile in args.tiles])
    print("| rows | keys | warps | stages | head dim | group | dtype | async copies | "
          "registers | spilled bytes |\n|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    codes = []
    for block_m, block_n, num_warps, num_stages in tiles:
        for head_dim in args.head_dims:
            for group_pad in args.groups:
                for dtype in args.dtypes:
                    code = compile_prefill(block_m, block_n, num_warps, num_stages,
                                           head_dim=head_dim, group_pad=group_pad,
                                           dtype=dtype, arch=args.arch, split=args.split)
                    codes.append(code)
                    print(f"| {block_m} | {block_n} | {num_warps} | {num_stages} | "
                          f"{head_dim} | {group_pad} | {dtype} | {code.async_copies} | "
                          f"{code.registers} | {code.spill_bytes} |", flush=True)
    if args.json_path is not None:
        Path(args.json_path).write_text(json.dumps([asdict(code) for code in codes], indent=1))
    return int(any(code.spill_bytes or not code.async_copies for code in codes))


if __name__ == "__main__":
    sys.exit(main())
