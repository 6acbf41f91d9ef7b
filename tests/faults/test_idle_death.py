"""A rank that dies while the pool is idle (real 2-rank CPU pool): the liveness monitor notices within seconds,
logs the rank and its signal, the next call raises WorkerDied naming that rank (not a raw pipe error), and the
call after it runs on a fresh pool.

The time limit is a deadline for the death to be noticed, not a performance assertion.
"""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest

from pool_helpers import cpu_pool
from wanmesh.parallel.driver.pool import IDLE_CHECK_S, WorkerError
from wanmesh.parallel.protocol import Diagnostic

NOTICED_WITHIN_S = 15 * IDLE_CHECK_S


def test_a_rank_killed_while_idle_is_named_at_the_next_call(caplog):
    with cpu_pool(world=2) as pool:
        pool.call(Diagnostic("echo"))
        victim = pool.pids()[1]
        with caplog.at_level(logging.WARNING, logger="wanmesh.pool"):
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + NOTICED_WITHIN_S
            while pool.running and time.monotonic() < deadline:
                time.sleep(0.1)
        assert not pool.running, f"the monitor did not notice the dead rank within {NOTICED_WITHIN_S:g} s"
        logged = [r.getMessage() for r in caplog.records if "died while the pool was idle" in r.getMessage()]
        assert logged and "rank 1" in logged[0] and "SIGKILL" in logged[0], logged
        with pytest.raises(WorkerError) as error:
            pool.call(Diagnostic("echo"))
        assert error.value.rank == 1 and error.value.error_type == "WorkerDied"
        assert "SIGKILL" in str(error.value) and "idle" in str(error.value)
        assert pool.call(Diagnostic("echo")).info["rank"] == 0  # a fresh pool serves
        assert victim not in pool.pids()
