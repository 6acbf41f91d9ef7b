"""The Ray backend on a local Ray started by the test: CPU actors with gloo, same results as the local pool."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from pool_helpers import traceback_deadline

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray[default]'); the Ray backend is untested")

from wanmesh.parallel import protocol as P  # noqa: E402
from wanmesh.parallel.config import ParallelConfig  # noqa: E402
from wanmesh.parallel.driver.pool import Cancelled, WorkerError, WorkerPool  # noqa: E402

DIAGNOSTICS = str(Path(__file__).with_name("pool_diagnostics.py"))
DEADLINE_S = 300
NOTICED_WITHIN_S = 30.0  # a deadline for the idle check, not a measurement


@pytest.fixture(scope="module")
def local_ray():
    with traceback_deadline(DEADLINE_S):
        ray.init(num_cpus=3, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
                 runtime_env={"env_vars": {"WANMESH_WORKER_THREADS": "1", "OMP_NUM_THREADS": "1"}})
        try:
            yield
        finally:
            ray.shutdown()


def test_ray_pool_results_progress_cancel_and_a_dead_actor(local_ray):
    config = ParallelConfig(world=2, devices="cpu", backend="ray")
    with WorkerPool(config, diagnostics=DIAGNOSTICS, timeout_s=120, start_timeout_s=240) as pool:
        x = torch.randn(6, 3, dtype=torch.float64)
        reply = pool.call(P.Diagnostic("scaled_gather", tensors=[x]))
        torch.testing.assert_close(reply.tensors[0], x * 2 + 1, rtol=0, atol=0)
        assert [r["rank"] for r in pool.health().ranks] == [0, 1]

        seen = []
        with pytest.raises(Cancelled):
            pool.call(P.Diagnostic("steps", {"steps": 1000, "step_s": 0.02}),
                      progress=lambda s, n: seen.append(s), should_cancel=lambda: len(seen) >= 3)
        assert seen[:3] == [1, 2, 3] and len(seen) < 1000

        victim = pool._backend.actor_pids()[1]
        with pytest.raises(WorkerError, match="rank 1: WorkerDied"):
            pool.call(P.Diagnostic("steps", {"steps": 1000, "step_s": 0.02}),
                      progress=lambda s, n: s == 2 and os.kill(victim, signal.SIGKILL))
        again = pool.call(P.Diagnostic("scaled_gather", tensors=[x]))
        torch.testing.assert_close(again.tensors[0], x * 2 + 1, rtol=0, atol=0)
        assert pool.starts == 2


def test_a_ray_actor_killed_while_idle_is_named_at_the_next_call(local_ray):
    """The liveness monitor pings idle actors: a killed one stops the pool within seconds and the next call raises
    WorkerDied naming its rank; the call after runs on fresh actors."""
    config = ParallelConfig(world=2, devices="cpu", backend="ray")
    with WorkerPool(config, diagnostics=DIAGNOSTICS, timeout_s=120, start_timeout_s=240) as pool:
        pool.call(P.Diagnostic("echo"))
        os.kill(pool._backend.actor_pids()[1], signal.SIGKILL)
        deadline = time.monotonic() + NOTICED_WITHIN_S
        while pool.running and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pool.running, f"the monitor did not notice the dead actor within {NOTICED_WITHIN_S:g} s"
        with pytest.raises(WorkerError) as error:
            pool.call(P.Diagnostic("echo"))
        assert error.value.rank == 1 and error.value.error_type == "WorkerDied" and "idle" in str(error.value)
        assert pool.call(P.Diagnostic("echo")).info["rank"] == 0
