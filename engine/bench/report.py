"""Shared output of the benchmarks: a two-column table on stdout and optional JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(title: str, results: dict[str, Any], json_path: str | None) -> None:
    """Prints `results` as a table under `title`; writes them as JSON to `json_path` if set."""
    width = max(len(key) for key in results)
    print(title)
    for key, value in results.items():
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        print(f"  {key:<{width}}  {shown}")
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {path}")
