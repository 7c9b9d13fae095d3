"""The resident memory of `continuum serve`'s processes (frontend, resource tracker, engine
core) before and after one 13.6 MB completion request: 4 prompts, n 16, 16 stop strings of
850,000 characters each. Before the hardening, such a body grew the core by about 1 GB, as
every one of the 64 engine requests carried its own copy of the stop strings.

    .venv/bin/python scripts/bench_amplification.py
"""

from pathlib import Path

import httpx

from eval.server_process import ServerProcess, ServerSpec, read_rss_mib

with ServerProcess(ServerSpec(serve_args=("--num-kv-blocks", "512"))) as server:
    pids = server.process_ids()
    before = {pid: read_rss_mib(pid) for pid in pids}
    body = {"model": "tiny", "prompt": ["a", "b", "c", "d"], "n": 16, "max_tokens": 4,
            "stop": [chr(ord("A") + i) * 850_000 for i in range(16)]}
    response = httpx.post(server.base_url + "/v1/completions", json=body, timeout=300)
    print("status", response.status_code, "body MB", round(len(str(body)) / 1e6, 1))
    after = {pid: read_rss_mib(pid) for pid in pids}
    for pid in pids:
        command = Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:60]
        print(pid, command, f"{before[pid]:.1f} -> {after[pid]:.1f} MiB")
