"""`eval/gpu/decode_tiles.py` picks the decode tile with the lowest geometric mean of its time
over the current tile's, across the scored shapes; a tile that failed at one is never picked,
and unscored shapes (whose calls measure the host) do not count."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

from engine.model.attention.triton_kernels import DecodeTile

REPO = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("decode_tiles",
                                              REPO / "eval" / "gpu" / "decode_tiles.py")
assert _spec is not None and _spec.loader is not None
decode_tiles = importlib.util.module_from_spec(_spec)
# Registered only while the module runs: its dataclasses look themselves up there.
sys.modules["decode_tiles"] = decode_tiles
try:
    _spec.loader.exec_module(decode_tiles)
finally:
    del sys.modules["decode_tiles"]

DEFAULT = DecodeTile(64, 4, 2)
WIDE = DecodeTile(128, 4, 3)
BROKEN = DecodeTile(128, 8, 3)


def _time(tile: DecodeTile, batch: int, us: float | None) -> object:
    """A result at (batch, 1024); batch 1 and 32 are scored below, batch 2 is not."""
    return decode_tiles.TileTime("bfloat16", tile, batch, 1024, 2, us, None if us is None else 1.0,
                                 None if us is not None else "OutOfResources")


def test_the_lowest_geometric_mean_wins_and_a_failed_tile_never_does() -> None:
    times = [_time(DEFAULT, 1, 100.0), _time(DEFAULT, 32, 100.0),
             # 0.5x then 1.6x: geometric mean 0.894x, though its sum of times is larger
             _time(WIDE, 1, 50.0), _time(WIDE, 32, 160.0),
             _time(BROKEN, 1, 10.0), _time(BROKEN, 32, None),
             # an unscored shape at which WIDE is far slower
             _time(DEFAULT, 2, 10.0), _time(WIDE, 2, 1000.0)]
    tile, score = decode_tiles.choose(times, DEFAULT, [(1, 1024), (32, 1024)])
    assert tile == WIDE
    assert score == pytest.approx((0.5 * 1.6) ** 0.5)


def test_no_choice_without_the_current_tile() -> None:
    times = [_time(DEFAULT, 1, None), _time(WIDE, 1, 50.0)]
    assert decode_tiles.choose(times, DEFAULT, [(1, 1024)]) is None
