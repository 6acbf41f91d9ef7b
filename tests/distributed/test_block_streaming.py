"""Models larger than a rank's memory budget stream their blocks: on real pools (world 1, tp 2, ulysses 2, ring 2,
cfg parallel 2), a VACE model (its VACE blocks stream too) under a ``memory_budget_gb`` below its share samples the
latents of the resident model on one device (world 1 exactly; the other layouts within the tolerance of their
parallel tests), moves each block once per model call (bytes counted on rank 0), leaves no block fetched between
calls and holds at most the budget on the device. Computing in bf16 (world 1 and tp 2, the budget sized from the bf16
model), the streamed run samples exactly the latents of the resident run of the same layout in bf16, which differ
from the fp32 ones, and holds at most the budget too (the estimate counts the modules kept in float32 and the
rotary tables). A budget below the rest plus two blocks is refused in one line, from the header, before any weight is read (the refusal
names the block size and the budget)."""

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
RUNS = {**{name: (name, "fp32") for name in LAYOUTS}, "world1_bf16": ("world1", "bf16"), "tp2_bf16": ("tp2", "bf16")}
BF16_LAYOUTS = ("world1", "tp2")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MIN_BF16_ERROR = 1e-4  # bf16 latents differ from fp32 ones: the model computed in bf16
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


def _sizes(tiny, tp: int, dtype: str = "fp32") -> BlockSizes:
    return BlockSizes.from_file(tiny["vace"], None, DTYPES[dtype], "keep", tp)


def _budget_gb(sizes: BlockSizes) -> float:
    """Between what streaming needs (the rest and two blocks) and the whole share."""
    streamed = sizes.rest + IN_FLIGHT_BLOCKS * sizes.largest_block
    return (streamed + sizes.total) / 2 / 1e9


@pytest.fixture(scope="module")
def resident(tiny) -> torch.Tensor:
    engine = RankExecutor("cpu")
    return engine.sample(_request(engine.load_model(tiny["vace"])))


@pytest.fixture(scope="module")
def resident_bf16(tiny) -> dict[str, torch.Tensor]:
    """The resident model's bf16 latents per layout: in this process at world 1, on a pool without a budget else."""
    engine = RankExecutor("cpu")
    results = {"world1": engine.sample(_request(engine.load_model(tiny["vace"], dtype="bf16")))}
    for name in BF16_LAYOUTS[1:]:
        with cpu_pool(**LAYOUTS[name]) as pool:
            runner = PoolRunner(pool)
            results[name] = runner.sample(_request(runner.load_model(tiny["vace"], dtype="bf16")))
    return results


@pytest.fixture(scope="module")
def runs(tiny) -> dict[str, dict]:
    """Each run's streamed sampling (see ``RUNS``): its latents, rank 0's streaming state, the model handle."""
    return {name: _streamed_run(tiny, LAYOUTS[layout], dtype) for name, (layout, dtype) in RUNS.items()}


def _streamed_run(tiny, layout: dict, dtype: str) -> dict:
    budget_gb = _budget_gb(_sizes(tiny, layout.get("tp", 1), dtype))
    with cpu_pool(**layout, memory_budget_gb=budget_gb, diagnostics=DIAGNOSTICS) as pool:
        runner = PoolRunner(pool)
        handle = runner.load_model(tiny["vace"], dtype=dtype)
        latents = runner.sample(_request(handle))
        state = pool.call(P.Diagnostic("streaming")).info  # rank 0 answers; every rank runs the same
    return {"latents": latents, "state": state, "streamer": state["models"][handle]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_streamed_blocks_sample_the_resident_latents(resident, runs, layout):
    assert resident.abs().max() > 0.1
    tolerance = 0 if layout == "world1" else PARALLEL_TOLERANCE
    torch.testing.assert_close(runs[layout]["latents"], resident, rtol=0, atol=tolerance)


@pytest.mark.parametrize("layout", BF16_LAYOUTS)
def test_streamed_bf16_blocks_sample_the_resident_bf16_latents(resident, resident_bf16, runs, layout):
    streamed = runs[f"{layout}_bf16"]["latents"]
    torch.testing.assert_close(streamed, resident_bf16[layout], rtol=0, atol=0)
    assert (streamed.float() - resident).norm() / resident.norm() > MIN_BF16_ERROR, "the run computed in bf16"


@pytest.mark.parametrize("run", RUNS)
def test_each_block_moves_once_per_model_call(runs, run):
    calls = STEPS * (1 if RUNS[run][0] == "cfg2" else CALLS_PER_STEP)
    streamer, budget = runs[run]["streamer"], runs[run]["state"]["budget"]
    assert streamer is not None, "rank 0 did not stream under its budget"
    assert streamer["fetched"] == 0, "no block stays on the device between model calls"
    assert streamer["bytes_moved"] == calls * streamer["block_bytes"]




@pytest.mark.parametrize("run", RUNS)
def test_the_streamed_model_holds_at_most_the_budget(runs, run):
    streamer, budget = runs[run]["streamer"], runs[run]["state"]["budget"]
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
