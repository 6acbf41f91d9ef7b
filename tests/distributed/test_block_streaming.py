"""Models larger than a rank's memory budget stream their blocks: on real pools (world 1, tp 2, ulysses 2, ring 2,
cfg parallel 2), a VACE model (its VACE blocks stream too) under a ``memory_budget_gb`` below its share samples the
latents of the resident model on one device (world 1 exactly; the other layouts within the tolerance of their
parallel tests), moves each block once per model call (bytes counted on rank 0), and
leaves no block fetched between calls; a budget below the rest plus two blocks is refused in one line, from the
header, before any weight is read (the refusal names the block size and the budget)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pool_helpers import cpu_pool, random_prompt_request, tiny_models_within
from wanmesh.parallel import protocol as P
from wanmesh.parallel.driver.runner import PoolRunner
from wanmesh.parallel.errors import WorkerError
from wanmesh.parallel.worker.block_streaming import IN_FLIGHT_BLOCKS, BlockSizes, size_text
from wanmesh.parallel.worker.executors import RankExecutor

DEADLINE_S = 900
DIAGNOSTICS = str(Path(__file__).with_name("streaming_diagnostics.py"))
LAYOUTS = {"world1": dict(world=1), "tp2": dict(world=2, tp=2), "ulysses2": dict(world=2, ulysses=2),
           "ring2": dict(world=2, ring=2), "cfg2": dict(world=2, cfg_parallel=True)}
STEPS = 2
CALLS_PER_STEP = 2  # guided: the conditional and the unconditional pass (one each under CFG parallel)
PARALLEL_TOLERANCE = 1e-4  # as the other layout tests: tp / ring sum in another order


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    yield from tiny_models_within(tmp_path_factory, DEADLINE_S)


def _request(handle: str) -> P.SampleRequest:
    generator = torch.Generator().manual_seed(6)
    frames = torch.randn(1, 32, 2, 4, 4, generator=generator)
    mask = torch.ones(1, 64, 2, 4, 4)
    return random_prompt_request(torch.zeros(1, 16, 2, 4, 4), generator, (7, 3), handle=handle, seed=2, steps=STEPS,
                                 guidance_scale=4.0, shift=3.0, sampler="euler", vace_frames=[frames],
                                 vace_masks=[mask], vace_strengths=[1.0])


def _sizes(tiny, tp: int) -> BlockSizes:
    return BlockSizes.from_file(tiny["vace"], None, torch.float32, "keep", tp)


def _budget_gb(sizes: BlockSizes) -> float:
    """Between what streaming needs (the rest and two blocks) and the whole share."""
    streamed = sizes.rest + IN_FLIGHT_BLOCKS * sizes.largest_block
    return (streamed + sizes.total) / 2 / 1e9


@pytest.fixture(scope="module")
def resident(tiny) -> torch.Tensor:
    engine = RankExecutor("cpu")
    return engine.sample(_request(engine.load_model(tiny["vace"])))


@pytest.fixture(scope="module")
def runs(tiny) -> dict[str, dict]:
    """Each layout's streamed run: its latents, rank 0's streaming state, the model handle."""
    results = {}
    for name, layout in LAYOUTS.items():
        with cpu_pool(**layout, memory_budget_gb=_budget_gb(_sizes(tiny, layout.get("tp", 1))),
                      diagnostics=DIAGNOSTICS) as pool:
            runner = PoolRunner(pool)
            handle = runner.load_model(tiny["vace"])
            latents = runner.sample(_request(handle))
            state = pool.call(P.Diagnostic("streaming")).info  # rank 0 answers; every rank runs the same
            results[name] = {"latents": latents, "state": state, "streamer": state["models"][handle]}
    return results


@pytest.mark.parametrize("layout", LAYOUTS)
def test_streamed_blocks_sample_the_resident_latents(resident, runs, layout):
    assert resident.abs().max() > 0.1
    tolerance = 0 if layout == "world1" else PARALLEL_TOLERANCE
    torch.testing.assert_close(runs[layout]["latents"], resident, rtol=0, atol=tolerance)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_block_moves_once_per_model_call(runs, layout):
    calls = STEPS * (1 if layout == "cfg2" else CALLS_PER_STEP)
    streamer, budget = runs[layout]["streamer"], runs[layout]["state"]["budget"]
    assert streamer is not None, "rank 0 did not stream under its budget"
    assert streamer["fetched"] == 0, "no block stays on the device between model calls"
    assert streamer["bytes_moved"] == calls * streamer["block_bytes"]
    assert streamer["device_bytes"] <= budget < streamer["block_bytes"] + streamer["device_bytes"]


def test_a_budget_below_two_blocks_is_refused_before_any_weight_is_read(tiny):
    sizes = _sizes(tiny, 1)
    budget_gb = (sizes.rest + sizes.largest_block) / 1e9  # one block fits, two do not
    with cpu_pool(world=1, memory_budget_gb=budget_gb) as pool:
        with pytest.raises(WorkerError) as refused:
            PoolRunner(pool).load_model(tiny["vace"])
    message = str(refused.value).splitlines()[0]
    assert "does not fit the memory budget" in message and f"{size_text(sizes.largest_block)} each" in message
    assert f"{size_text(int(budget_gb * 1e9))} per rank" in message
