"""Each worker process names its rank on its command line, so `ps` shows which process is which rank."""

from __future__ import annotations

import psutil

from wanmesh.parallel.bench.soak import worker_rank
from wanmesh.parallel.config import ParallelConfig
from wanmesh.parallel.driver.pool import WorkerPool


def test_worker_command_lines_name_their_rank(monkeypatch):
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    with WorkerPool(ParallelConfig(world=2, devices="cpu"), timeout_s=120) as pool:
        ranks = [pool.health().ranks[i]["rank"] for i in range(2)]
        shown = [worker_rank(psutil.Process(pid)) for pid in pool.pids()]
    assert ranks == [0, 1]
    assert shown == [0, 1]
