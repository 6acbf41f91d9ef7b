"""`wanmesh bench soak` against a real ComfyUI server with a handful of prompts of the mixed set (T2V, LoRA
change, VACE, I2V): it runs them, finds the server and its workers, and prints the table and writes the JSON with
every figure. It only checks that the command works; the numbers of so few prompts are noise and are printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

PROMPTS = 5  # one warm-up, then one of each kind


def test_soak_runs_the_mix_and_reports_memory_fds_and_shared_memory(comfyui_server, tmp_path):
    out = tmp_path / "soak.json"
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from wanmesh.parallel.cli import main; sys.exit(main(sys.argv[1:]))",
         "bench", "soak", "--server", comfyui_server.base_url, "--prompts", str(PROMPTS), "--warm-up", "1",
         "--server-pid", str(comfyui_server._process.pid), "--json", str(out)],
        capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n--- log ---\n{comfyui_server.log()[-3000:]}"
    print("\n" + "\n".join(line for line in result.stdout.splitlines() if line.startswith(("soak:", "|"))))
    figures = json.loads(Path(out).read_text())
    assert figures["prompts"] == PROMPTS and figures["warm_up"] == 1
    assert figures["final"]["workers"] == 2 and len(figures["final"]["worker_rss"]) == 2
    for row in ("server RSS (MiB)", "workers RSS, sum (MiB)", "server fds", "worker fds, sum",
                "/dev/shm segments"):
        assert set(figures["rows"][row]) == {"after_warm_up", "final", "growth_percent"}
        assert f"| {row}" in result.stdout
    assert figures["final"]["server_rss"] > 0 and all(rss > 0 for rss in figures["final"]["worker_rss"])
