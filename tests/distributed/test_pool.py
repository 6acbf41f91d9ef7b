"""The local worker pool on CPU ranks with gloo: results, progress, cancel, faults, restarts, no orphans.

Workers run the diagnostic ops of ``pool_diagnostics.py`` (step loops with collectives, injected faults).
Every test has a hard deadline, and every test checks that the workers it started are gone afterwards.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from pool_helpers import traceback_deadline

from wanmesh.parallel import protocol as P
from wanmesh.parallel.config import ParallelConfig
from wanmesh.parallel.driver.pool import Cancelled, WorkerError, WorkerPool, close_cached_pool, get_pool

DIAGNOSTICS = str(Path(__file__).with_name("pool_diagnostics.py"))
PACK_DIR = Path(__file__).resolve().parents[2]
TEST_DEADLINE_S = 150
# Generous bounds that still prove a fault is reported without waiting for a long timeout (600 s default).
FAULT_REPORTED_WITHIN_S = 60


@pytest.fixture(autouse=True)
def hard_deadline(monkeypatch):
    monkeypatch.setenv("WANMESH_WORKER_THREADS", "1")
    with traceback_deadline(TEST_DEADLINE_S):
        yield


def family(pids: list[int]) -> list[psutil.Process]:
    """The worker processes and everything they started (e.g. Python's resource tracker)."""
    found = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            found += [proc, *proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return found


def assert_all_gone(processes: list[psutil.Process], within_s: float = 15.0) -> None:
    gone, alive = psutil.wait_procs(processes, timeout=within_s)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"processes outlived their pool: {[(p.pid, p.cmdline()[:3]) for p in alive]}"


def make_pool(world: int, **options) -> WorkerPool:
    return WorkerPool(ParallelConfig(world=world, devices="cpu"), diagnostics=DIAGNOSTICS, **options)


def scaled_gather(pool: WorkerPool, x: torch.Tensor) -> torch.Tensor:
    return pool.call(P.Diagnostic("scaled_gather", tensors=[x])).tensors[0]


def test_world_two_equals_world_one_and_an_independent_reference():
    x = torch.randn(6, 5, dtype=torch.float64)
    results = {}
    for world in (1, 2):
        with make_pool(world) as pool:
            started = family(pool.pids())
            assert len(pool.pids()) == world
            results[world] = scaled_gather(pool, x)
            health = pool.health()
            assert [r["rank"] for r in health.ranks] == list(range(world))
            assert len({r["pid"] for r in health.ranks}) == world
            prefix, workers = pool._backend.shm_prefix, list(pool._backend.procs)
        assert_all_gone(started)
        # each rank left by itself when told to shut down, not by the driver's kill after the grace period
        assert [worker.returncode for worker in workers] == [0] * world
        assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)], "shared memory outlived the pool"
        with pytest.raises(RuntimeError, match="closed"):
            pool.health()
    torch.testing.assert_close(results[1], x * 2 + 1, rtol=0, atol=0)
    torch.testing.assert_close(results[2], results[1], rtol=0, atol=0)


def test_echo_moves_every_dtype_through_shared_memory():
    tensors = [torch.rand(3, 4, 5), torch.randn(7).bfloat16(), torch.arange(5, dtype=torch.int64),
               torch.tensor([True, False]), torch.zeros(0, 3), torch.randn(4, 3).t()]
    with make_pool(1) as pool:
        echoed = pool.call(P.Diagnostic("echo", tensors=tensors)).tensors
    for sent, got in zip(tensors, echoed):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got, sent)


class TestFaultsAndCancel:
    """One pool, world 2, taken through every fault; each time the next request must work again."""

    @pytest.fixture(scope="class")
    def pool(self):
        faulthandler.dump_traceback_later(TEST_DEADLINE_S, exit=True)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("WANMESH_WORKER_THREADS", "1")
            pool = make_pool(2, timeout_s=120)
        with pool:
            yield pool

    def test_nothing_listens_beyond_loopback(self, pool):
        listening = [c for p in family(pool.pids()) for c in p.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN]
        assert listening, "gloo listens on something; the test must see it"
        assert all(c.laddr.ip in ("127.0.0.1", "::1") for c in listening), listening

    def test_a_full_collection_walks_only_what_was_made_after_the_imports(self, pool):
        # Every unload runs gc.collect(); the imported code (frozen at start) would make each take about 0.5 s.
        info = pool.call(P.Diagnostic("collector", {})).info
        assert info["frozen"] > 5 * info["tracked"], info

    def test_progress_reaches_the_caller(self, pool):
        seen = []
        reply = pool.call(P.Diagnostic("steps", {"steps": 4, "step_s": 0.0}), progress=lambda s, n: seen.append((s, n)))
        assert reply.info == {"steps": 4}
        assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]

    def test_cancel_stops_every_rank_at_a_step_boundary(self, pool):
        pids, seen = pool.pids(), []
        with pytest.raises(Cancelled, match="cancelled"):
            pool.call(P.Diagnostic("steps", {"steps": 1000, "step_s": 0.02}),
                      progress=lambda s, n: seen.append(s), should_cancel=lambda: len(seen) >= 3)
        assert 3 <= len(seen) < 1000 and seen == list(range(1, len(seen) + 1))
        assert pool.pids() == pids, "a cancel must not restart the pool"
        assert torch.equal(scaled_gather(pool, torch.ones(4)), torch.full((4,), 3.0))

    def test_an_exception_from_the_progress_callback_cancels_and_propagates(self, pool):
        class Interrupted(Exception):
            pass

        def progress(step, total):
            if step == 2:
                raise Interrupted("host interrupt")

        pids = pool.pids()
        with pytest.raises(Interrupted):
            pool.call(P.Diagnostic("steps", {"steps": 1000, "step_s": 0.02}), progress=progress)
        assert pool.pids() == pids
        assert pool.health().ranks[1]["pid"] == pids[1]

    def test_an_error_on_every_rank_keeps_the_pool(self, pool):
        pids = pool.pids()
        with pytest.raises(WorkerError) as caught:
            pool.call(P.Diagnostic("fail", {"ranks": [0, 1]}))
        assert caught.value.error_type == "ValueError" and caught.value.rank in (0, 1)
        assert pool.pids() == pids
        with pytest.raises(WorkerError, match="unknown diagnostic op 'nope'"):
            pool.call(P.Diagnostic("nope"))
        with pytest.raises(P.ProtocolError, match="cannot cross the worker boundary"):
            pool.call(P.Diagnostic("echo", {"callback": print}))
        assert pool.pids() == pids

    def test_a_rank_that_raises_becomes_a_clear_error(self, pool):
        old = family(pool.pids())
        started = time.monotonic()
        with pytest.raises(WorkerError) as caught:
            pool.call(P.Diagnostic("fail", {"ranks": [1]}))
        elapsed = time.monotonic() - started
        error = caught.value
        assert (error.rank, error.error_type) == (1, "ValueError")
        assert "injected failure on rank 1" in error.message and "ranks [0] were left waiting" in error.message
        assert "pool_diagnostics.py" in error.traceback and "in fail" in error.traceback
        assert "rank 1: ValueError: injected failure" in str(error) and "Traceback" in str(error)
        assert elapsed < FAULT_REPORTED_WITHIN_S
        assert_all_gone(old)
        self._next_request_works(pool, old)

    def test_a_hung_rank_times_out(self, pool):
        old = family(pool.pids())
        started = time.monotonic()
        with pytest.raises(WorkerError) as caught:
            pool.call(P.Diagnostic("hang", {"rank": 1}), timeout_s=2)
        assert time.monotonic() - started < FAULT_REPORTED_WITHIN_S
        assert (caught.value.rank, caught.value.error_type) == (1, "Timeout")
        assert "ranks [1] sent nothing for 2 s" in caught.value.message
        assert_all_gone(old)
        self._next_request_works(pool, old)

    def test_a_rank_killed_mid_sample(self, pool):
        old = family(pool.pids())
        victim = pool.pids()[1]

        def progress(step, total):
            if step == 2:
                os.kill(victim, signal.SIGKILL)

        started = time.monotonic()
        with pytest.raises(WorkerError) as caught:
            pool.call(P.Diagnostic("steps", {"steps": 1000, "step_s": 0.02}), progress=progress)
        assert time.monotonic() - started < FAULT_REPORTED_WITHIN_S
        assert (caught.value.rank, caught.value.error_type) == (1, "WorkerDied")
        assert "killed by SIGKILL" in caught.value.message
        assert_all_gone(old)
        self._next_request_works(pool, old)

    @staticmethod
    def _next_request_works(pool, old):
        assert torch.equal(scaled_gather(pool, torch.arange(4.0)), torch.arange(4.0) * 2 + 1)
        assert not set(pool.pids()) & {p.pid for p in old}


DRIVER = """
import sys, time, types
pack = types.ModuleType({module!r}); pack.__path__ = [{pack_dir!r}]; sys.modules[{module!r}] = pack
from {module}.parallel.config import ParallelConfig
from {module}.parallel.driver.pool import WorkerPool
from {module}.parallel.protocol import Diagnostic
import torch
pool = WorkerPool(ParallelConfig(world=2, devices="cpu"))
pool.call(Diagnostic("echo", tensors=[torch.ones(1000)]))  # both sides now own shared-memory segments
print(" ".join(str(r["pid"]) for r in pool.health().ranks), flush=True)
time.sleep(600)
"""


def test_workers_die_with_a_killed_driver_loaded_under_any_module_name(tmp_path):
    """The driver imports the pack as ComfyUI would (any folder name), then is SIGKILLed: no worker remains."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER.format(module="some_custom_folder", pack_dir=str(PACK_DIR)))
    env = {**os.environ, "WANMESH_WORKER_THREADS": "1"}
    driver = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = driver.stdout.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 2, f"driver printed {line!r}"
        workers = family(pids)
        segments = [n for n in os.listdir("/dev/shm") if n.startswith(f"wanmesh_{driver.pid}_")]
        assert len(segments) == 2, segments  # the driver's request arena and rank 0's reply arena
    finally:
        driver.kill()
        driver.wait()
    assert_all_gone(workers)
    deadline = time.monotonic() + 15  # Python's resource tracker of the dead driver unlinks them
    while time.monotonic() < deadline and any(os.path.exists(f"/dev/shm/{n}") for n in segments):
        time.sleep(0.2)
    assert not [n for n in segments if os.path.exists(f"/dev/shm/{n}")], "shared memory outlived a killed driver"


def test_get_pool_reuses_equal_configs_and_restarts_on_a_change():
    try:
        first = get_pool(ParallelConfig(world=1, devices="cpu"))
        assert get_pool(ParallelConfig(world=1, devices="cpu")) is first
        old = family(first.pids())
        second = get_pool(ParallelConfig(world=1, devices="cpu", vae_patch=2))
        assert second is not first and second.health().ranks[0]["pid"] != old[0].pid
        assert_all_gone(old)
        with pytest.raises(RuntimeError, match="closed"):
            first.health()
    finally:
        close_cached_pool()


def test_a_bad_device_list_keeps_the_live_pool_and_workers_never_inherit_the_hosts_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # a host narrowed to one GPU (ComfyUI's --cuda-device 1)
    try:
        pool = get_pool(ParallelConfig(world=1, devices="cpu"))
        pids = [p.pid for p in family(pool.pids())]
        assert [rank["visible_gpus"] for rank in pool.health().ranks] == [""]
        with pytest.raises(ValueError, match=r"devices cuda:7 do not exist"):
            get_pool(ParallelConfig(world=1, devices="cuda:7"))
        assert get_pool(ParallelConfig(world=1, devices="cpu")) is pool
        assert pool.health().ranks[0]["pid"] in pids  # the same workers, still answering
    finally:
        close_cached_pool()


def test_a_worker_that_fails_to_start_is_a_clear_error(tmp_path):
    broken = tmp_path / "broken_diagnostics.py"
    broken.write_text("raise RuntimeError('cannot set up this rank')\n")
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(WorkerError, match=r"rank \d: RuntimeError: cannot set up this rank"):
        WorkerPool(ParallelConfig(world=2, devices="cpu"), diagnostics=str(broken))
    assert_all_gone(list(set(psutil.Process().children(recursive=True)) - before))


def test_bad_configs_fail_before_any_process_starts():
    before = set(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match="world=2 ranks need 2 GPUs but 0 are visible"):
        WorkerPool(ParallelConfig(world=2, devices="cuda"))
    assert set(psutil.Process().children(recursive=True)) <= before
