"""Two experts (Wan 2.2 A14B) and step ranges on one device: the boundary picks the expert of each step as the
reference rule says (checked against timesteps taken from diffusers' schedulers directly), boundary 0 and 1
reduce to one-model runs, two chained samplers equal one two-expert run, and bad input fails before sampling."""

from __future__ import annotations


import pytest
import torch
from diffusers import UniPCMultistepScheduler


from wanmesh.parallel.config import latent_shape
from wanmesh.parallel.weights.checkpoint import ModelFileError
from wanmesh.parallel.weights.detect import infer_transformer_config
from wanmesh.parallel.protocol import SampleRequest
from wanmesh.parallel.sampling.loop import pad_to_wan_text_length, sample
from wanmesh.parallel.sampling.schedules import schedule
from wanmesh.parallel.worker.executors import RankExecutor

WIDTH, HEIGHT, FRAMES, STEPS, SHIFT = 64, 48, 5, 6, 3.0


def _embedding(seed: int, length: int) -> list[torch.Tensor]:
    return [pad_to_wan_text_length(torch.randn(length, 64, generator=torch.Generator().manual_seed(seed)))]


def _request(**overrides) -> SampleRequest:
    fields = dict(handle="", latent=torch.zeros(latent_shape(WIDTH, HEIGHT, FRAMES)), positive=_embedding(1, 7),
                  negative=_embedding(2, 3), seed=7, steps=STEPS, guidance_scale=4.0, shift=SHIFT, sampler="unipc")
    fields.update(overrides)
    return SampleRequest(**fields)


def _reference_timesteps(sampler: str) -> list[float]:
    """The schedule's timesteps, independent of the loop: straight from diffusers for Wan's UniPC, from the simple
    sigma schedule (itself compared with ComfyUI's in test_comfy_samplers.py) for ComfyUI's euler."""
    if sampler != "unipc":
        return (schedule("simple", STEPS, SHIFT)[:-1] * 1000).tolist()  # float32, as the model gets them
    scheduler = UniPCMultistepScheduler(num_train_timesteps=1000, prediction_type="flow_prediction",
                                        use_flow_sigmas=True, flow_shift=SHIFT)
    scheduler.set_timesteps(STEPS)
    return [float(t) for t in scheduler.timesteps]


@pytest.fixture(scope="module")
def engine(tiny_models):
    executor = RankExecutor("cpu")
    handles = {name: executor.load_model(str(tiny_models[name])) for name in ("t2v", "t2v_low")}
    return executor, handles["t2v"], handles["t2v_low"]


def _run(engine, **overrides):
    executor, _, _ = engine
    reply = executor.sample_latents(_request(**overrides))
    return reply.latents, reply.expert_steps


def test_boundary_zero_equals_the_high_noise_expert_alone(engine):
    _, high, low = engine
    two, report = _run(engine, handle=high, handle_low=low, boundary=0.0, guidance_scale_low=1.0)
    alone, _ = _run(engine, handle=high)
    assert torch.equal(two, alone)
    assert report == f"high-noise expert: steps 0-{STEPS - 1}"


def test_boundary_one_equals_the_low_noise_expert_alone_with_its_own_cfg(engine):
    _, high, low = engine
    two, report = _run(engine, handle=high, handle_low=low, boundary=1.0, guidance_scale_low=2.5)
    alone, _ = _run(engine, handle=low, guidance_scale=2.5)
    assert max(_reference_timesteps("unipc")) < 1000, "every unipc timestep is below boundary x 1000"
    assert torch.equal(two, alone)
    assert report == f"low-noise expert: steps 0-{STEPS - 1}"


class _Recording(torch.nn.Module):
    """A resident model that records the timestep of every call (each guided step calls it twice)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config, self.timesteps = model, model.config, []

    def forward(self, *args, timestep, **kwargs):
        self.timesteps.append(float(timestep[0]))
        return self.model(*args, timestep=timestep, **kwargs)


@pytest.mark.parametrize("sampler", ["unipc", "euler"])
def test_mixed_run_switches_where_the_timesteps_cross_the_boundary(engine, sampler):
    executor, high, low = engine
    boundary = 0.875
    expected_high = [t for t in _reference_timesteps(sampler) if t >= boundary * 1000]
    expected_low = [t for t in _reference_timesteps(sampler) if t < boundary * 1000]
    assert expected_high and expected_low, "the boundary must fall inside the schedule for this test to mean anything"
    recording_high, recording_low = _Recording(executor._get(high, "model")), _Recording(executor._get(low, "model"))
    request = _request(handle=high, handle_low=low, boundary=boundary, sampler=sampler)
    mixed = sample(recording_high, request, low_model=recording_low)
    assert recording_high.timesteps == [t for t in expected_high for _ in range(2)]  # conditional + unconditional
    assert recording_low.timesteps == [t for t in expected_low for _ in range(2)]

    reported, report = _run(engine, handle=high, handle_low=low, boundary=boundary, sampler=sampler)
    split = len(expected_high)
    high_steps = "step 0" if split == 1 else f"steps 0-{split - 1}"
    assert report == f"high-noise expert: {high_steps}, low-noise expert: steps {split}-{STEPS - 1}"
    assert torch.equal(reported, mixed)
    only_high, _ = _run(engine, handle=high, sampler=sampler)
    only_low, _ = _run(engine, handle=low, sampler=sampler)
    assert (mixed - only_high).abs().max() > 1e-2 and (mixed - only_low).abs().max() > 1e-2


def _boundary_between_steps(sampler: str, split: int) -> float:
    """A boundary that gives the first `split` steps to the high-noise expert."""
    timesteps = _reference_timesteps(sampler)
    return (timesteps[split - 1] + timesteps[split]) / 2 / 1000


@pytest.mark.parametrize("split", [2, 4])
def test_two_chained_euler_samplers_equal_one_two_expert_run(engine, split):
    _, high, low = engine
    common = dict(sampler="euler", guidance_scale=4.0)
    one, report = _run(engine, handle=high, handle_low=low, boundary=_boundary_between_steps("euler", split),
                       guidance_scale_low=2.0, **common)
    first, first_report = _run(engine, handle=high, end_step=split, **common)
    second, second_report = _run(engine, handle=low, latent=first, start_step=split, add_noise=False,
                                 **{**common, "guidance_scale": 2.0})
    assert report == f"high-noise expert: steps 0-{split - 1}, low-noise expert: steps {split}-{STEPS - 1}"
    assert first_report == f"model: steps 0-{split - 1}" and second_report == f"model: steps {split}-{STEPS - 1}"
    torch.testing.assert_close(second, one, rtol=0, atol=1e-5)
    assert (first - one).abs().max() > 0.1, "the first sampler's latent keeps its leftover noise"


def test_chained_unipc_is_close_and_says_it_restarts_its_history(engine):
    _, high, low = engine
    one, _ = _run(engine, handle=high, handle_low=low, boundary=_boundary_between_steps("unipc", 3))
    first, _ = _run(engine, handle=high, end_step=3)
    second, report = _run(engine, handle=low, latent=first, start_step=3, add_noise=False)
    assert "unipc restarts its multistep history at step 3" in report
    assert (second - one).abs().max() < 0.2 * one.abs().max()


def test_start_step_with_noise_added_matches_a_hand_noised_latent(engine):
    """add_noise at start_step k mixes the seeded noise in at sigma_k (ComfyUI's noise scaling for flow models). A
    latent given without added noise is scaled by 1 - sigma_k, so a hand-noised one is handed over divided by it,
    as ComfyUI's KSamplerAdvanced returns a leftover-noise latent."""
    _, high, _ = engine
    from wanmesh.parallel.sampling.latents import denormalize_latents, normalize_latents, seeded_noise

    source = torch.randn(latent_shape(WIDTH, HEIGHT, FRAMES), generator=torch.Generator().manual_seed(3))
    sigma = float(schedule("simple", STEPS, SHIFT)[2])
    noised = sigma * seeded_noise(tuple(source.shape), 7) + (1 - sigma) * normalize_latents(source)
    added, _ = _run(engine, handle=high, latent=source, start_step=2, sampler="euler")
    given, _ = _run(engine, handle=high, latent=denormalize_latents(noised / (1 - sigma)), start_step=2, add_noise=False,
                    sampler="euler")
    torch.testing.assert_close(added, given, rtol=1e-5, atol=1e-5)  # raw <-> normalised round trip


@pytest.mark.parametrize("overrides, message", [
    ({"boundary": 1.5}, r"boundary must be a number in \[0, 1\].*got 1.5"),
    ({"boundary": -0.1}, r"boundary must be a number in \[0, 1\].*got -0.1"),
    ({"start_step": 4, "end_step": 4}, "start_step=4, end_step=4 is not valid for 6 steps"),
    ({"start_step": 6}, "start_step=6, end_step=6 is not valid for 6 steps"),
    ({"end_step": 7}, "end_step=7 is not valid for 6 steps"),
    ({"guidance_scale_low": float("nan")}, "low-noise expert's guidance scale"),
])
def test_bad_two_expert_settings_fail_in_the_driver_check(overrides, message):
    with pytest.raises(ValueError, match=message) as error:
        _request(**overrides).validate()
    assert "\n" not in str(error.value)


def test_experts_of_different_sizes_or_kinds_fail_before_sampling(tiny_models, engine):
    executor, high, _ = engine
    vace = executor.load_model(str(tiny_models["vace"]))
    steps_run = []
    with pytest.raises(ValueError, match=r"experts differ in vace_layers None vs \[0, 2\]") as error:
        executor.sample(_request(handle=high, handle_low=vace), progress=lambda s, t: steps_run.append(s))
    assert "\n" not in str(error.value) and steps_run == []
    executor.unload(vace)


def _a14b_expert_shapes(dim: int, in_channels: int) -> dict:
    """Header shapes of a Wan 2.2 A14B expert (the Wan 2.1 14B layout), changed where asked."""
    return {"patch_embedding.weight": (dim, in_channels, 1, 2, 2), "blocks.0.ffn.0.weight": (13824, dim),
            "blocks.39.ffn.0.weight": (13824, dim), "head.head.weight": (64, dim),
            "text_embedding.0.weight": (dim, 4096), "time_embedding.0.weight": (dim, 256)}


def test_wan22_a14b_expert_shapes_read_as_the_wan21_14b_config():
    config = infer_transformer_config(_a14b_expert_shapes(5120, 16), None)
    assert (config["num_attention_heads"], config["num_layers"], config["in_channels"]) == (40, 40, 16)
    assert "vace_layers" not in config


def test_wan22_ti2v_5b_and_i2v_experts_load_and_other_input_widths_are_refused_at_load():
    config = infer_transformer_config(_a14b_expert_shapes(3072, 48), None)
    assert config["in_channels"] == 48  # Wan 2.2 TI2V 5B: tests/unit/test_ti2v.py
    with pytest.raises(ModelFileError, match="32 input channels"):
        infer_transformer_config(_a14b_expert_shapes(5120, 32), None)
    config = infer_transformer_config(_a14b_expert_shapes(5120, 36), None)
    assert config["in_channels"] == 36 and "image_dim" not in config


def test_reply_reports_one_model_runs_and_step_ranges(engine):
    _, high, _ = engine
    _, report = _run(engine, handle=high, start_step=1, end_step=3, sampler="euler")
    assert report == "model: steps 1-2"
    _, report = _run(engine, handle=high, start_step=5, sampler="euler")
    assert report == "model: step 5"


def test_tiny_low_noise_expert_shares_the_t2v_config_with_other_weights(tiny_models):
    from safetensors import safe_open

    configs, first_weights = [], []
    for name in ("t2v", "t2v_low"):
        with safe_open(str(tiny_models[name]), "pt") as file:
            shapes = {key: tuple(file.get_slice(key).get_shape()) for key in file.keys()}
            configs.append(infer_transformer_config(shapes, file.metadata()))
            first_weights.append(file.get_tensor("blocks.0.self_attn.q.weight"))
    assert configs[0] == configs[1]
    assert not torch.allclose(first_weights[0], first_weights[1])
