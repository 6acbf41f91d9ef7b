"""Running the `wanmesh` command as a user does (a fresh interpreter per run) from the test process, with the
test hooks of ``faults/cli_launcher.py``: whether a worker pool started, and the run's exit code and output."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

LAUNCHER = Path(__file__).resolve().parent / "faults" / "cli_launcher.py"
RUN_TIMEOUT_S = 240


def run_cli(args: list[str], workdir: Path, env_extra: dict | None = None) -> dict:
    """``wanmesh ARGS`` in ``workdir``: {code, stderr, stdout, seconds, pool_started}."""
    marker = workdir / f"pool-marker-{time.monotonic_ns()}"
    env = {**os.environ, "WANMESH_TEST_POOL_MARKER": str(marker), "OMP_NUM_THREADS": "1", **(env_extra or {})}
    started = time.monotonic()
    result = subprocess.run([sys.executable, str(LAUNCHER), *args], capture_output=True, text=True,
                            timeout=RUN_TIMEOUT_S, env=env, cwd=workdir)
    return {"code": result.returncode, "stderr": result.stderr, "stdout": result.stdout,
            "seconds": time.monotonic() - started, "pool_started": marker.exists()}
