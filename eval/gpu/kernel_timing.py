"""A kernel call's time on a GPU, three ways: the device's, its eager calls', the host's.

Scripts that time kernels (`eval/gpu/prefill_tiles.py` all three, `eval/gpu/fp8_gemms.py` the
graph's and the host's) report more than device events, because a call whose host work
outlasts its device work is timed wrongly by device events alone: `triton.testing.do_bench`
flushes the L2 cache with a kernel of about 80 us on an H100 before each call, and when the
call's launch takes longer than that, the device sits idle inside the call's events until
the launch arrives.
- `graph_us`: the device's, from a CUDA graph of the calls replayed
  (`triton.testing.do_bench_cudagraph`): no launch is timed and the L2 cache is warm from the
  call before. None where the call cannot be captured.
- `eager_us`: `do_bench`'s median of device events around each eager call after the flush.
- `host_us`: the median host time of an eager call (its Python and launches), the device's
  queue drained untimed every `drain_every` calls so that no launch waits for a full queue.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable


def graph_us(fn: Callable[[], object]) -> float | None:
    """Device microseconds a call of `fn` from a replayed CUDA graph of its calls (CUDA only);
    None, with the reason on stderr, where capturing the call fails."""
    from triton.testing import do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, return_mode="median") * 1e3
    except RuntimeError as error:
        print(f"no CUDA graph of the call: {str(error).splitlines()[0]}", file=sys.stderr)
        return None


def eager_us(fn: Callable[[], object]) -> float:
    """Device-event microseconds around an eager call of `fn`, after an L2 flush (CUDA only;
    holds part of the launch when the host is slower than the flush)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def host_us(fn: Callable[[], object], drain: Callable[[], object], calls: int = 200,
            drain_every: int = 20) -> float:
    """The median host microseconds of a call of `fn`, `drain` (waiting for the device's
    queue, e.g. `torch.cuda.synchronize`) run untimed every `drain_every` calls."""
    call_us = []
    for index in range(calls):
        if index % drain_every == 0:
            drain()
        started = time.perf_counter()
        fn()
        call_us.append((time.perf_counter() - started) * 1e6)
    drain()
    return statistics.median(call_us)


def host_clock_us(fn: Callable[[], object], runs: int = 5) -> float:
    """The median host microseconds of `runs` calls of `fn` after one untimed call: a CPU dry
    run's time, where the host computes the call itself."""
    fn()
    run_us = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        run_us.append((time.perf_counter() - started) * 1e6)
    return statistics.median(run_us)


def parse_script_arguments(doc: str) -> argparse.Namespace:
    """The command line of a script that times kernels at a model's shapes over token counts
    (described by `doc`'s first line): `--device cuda|cpu` (cpu: a dry run with small
    shapes), `--tokens N ...` (None: the script's own) and `--json FILE`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tokens", type=int, nargs="+", default=None)
    parser.add_argument("--json", dest="json_path", default=None)
    return parser.parse_args()
