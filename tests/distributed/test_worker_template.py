"""The worker template on CPU pools (``parallel/worker/template.py``): every worker is a fork of the driver's one
template; a template with live workers is never stopped; a killed template takes its workers with it (they take
it for their driver), the pool names the dead rank, and the next call starts a fresh template and pool; with
``WANMESH_WORKER_TEMPLATE=0`` each worker starts in its own interpreter."""

from __future__ import annotations

import os
import signal

import psutil
import pytest
from pool_helpers import cpu_pool, traceback_deadline, wait_gone

from wanmesh.parallel import protocol as P
from wanmesh.parallel.driver.pool import WorkerError
from wanmesh.parallel.driver.worker_template import TEMPLATE_ENV, shared_template_pid, stop_template

TEST_DEADLINE_S = 150


@pytest.fixture(autouse=True)
def deadline(monkeypatch):
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    monkeypatch.delenv(TEMPLATE_ENV, raising=False)
    with traceback_deadline(TEST_DEADLINE_S):
        yield


def parents(pool) -> set[int]:
    return {psutil.Process(pid).ppid() for pid in pool.pids()}


def test_a_killed_template_takes_its_workers_and_the_next_call_starts_afresh():
    with cpu_pool(world=2) as pool:
        pool.call(P.Diagnostic("echo"))
        template = shared_template_pid()
        assert template is not None and parents(pool) == {template}
        assert stop_template() is False and shared_template_pid() == template, "stopped a template with live workers"
        old = pool.pids()
        os.kill(template, signal.SIGKILL)
        assert not wait_gone(old, 15.0), "workers outlived the template that forked them"
        with pytest.raises(WorkerError, match=r"rank \d"):
            pool.call(P.Diagnostic("echo"))
        pool.call(P.Diagnostic("echo"))  # a fresh pool, forked by a fresh template
        fresh = shared_template_pid()
        assert fresh not in (None, template) and parents(pool) == {fresh}
        assert not set(pool.pids()) & set(old)
    assert stop_template() is True and shared_template_pid() is None


def test_without_the_template_each_worker_is_the_drivers_own_child(monkeypatch):
    monkeypatch.setenv(TEMPLATE_ENV, "0")
    with cpu_pool(world=2) as pool:
        pool.call(P.Diagnostic("echo"))
        assert parents(pool) == {os.getpid()}
