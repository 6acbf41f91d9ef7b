"""The workers' copies of ComfyUI's schedulers and samplers (``sampling/schedules.py``, ``sampling/solvers.py``)
against ComfyUI's own functions in the recent ComfyUI copy the tests install.

ComfyUI runs in a subprocess inside that copy: ``calculate_sigmas`` on its discrete-flow model sampling for every
scheduler the workers offer (several shifts and step counts, KSampler's denoise < 1 cut), and each k-diffusion
sampler on the same toy flow denoiser, start latent, sigmas and seed. The toy denoiser is a fixed nonlinear
function of the latent and sigma, so every step rule, including the ancestral noise draws, is exercised.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from wanmesh.parallel.config import COMFY_SAMPLERS, SCHEDULERS
from wanmesh.parallel.sampling.loop import ancestral_noise
from wanmesh.parallel.sampling.schedules import run_sigmas, schedule
from wanmesh.parallel.sampling.solvers import solve

SHIFTS = (1.0, 3.0, 8.0)
STEP_COUNTS = (1, 4, 13)
SEED = 77
SHAPE = (2, 3, 2, 4, 4)
TOLERANCE = 1e-5

NATIVE = r"""
import sys
out_file = sys.argv[1]
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()
import torch, comfy.samplers, comfy.model_sampling
from comfy.k_diffusion import sampling as k
from comfy.extra_samplers import uni_pc
from safetensors.torch import save_file

class Flow(comfy.model_sampling.ModelSamplingDiscreteFlow, comfy.model_sampling.CONST):
    pass

def flow(shift):
    sampling = Flow()
    sampling.set_parameters(shift=shift, multiplier=1000)
    return sampling

class Toy(torch.nn.Module):  # k-diffusion's model: (x, sigma) -> denoised; a flow model's CONST sampling
    def __init__(self, sampling):
        super().__init__()
        patcher = type("Patcher", (), {"get_model_object": lambda self, name: sampling})()  # newer samplers read it
        self.inner_model = type("Inner", (), {"inner_model": type("M", (), {"model_sampling": sampling})(),
                                              "model_patcher": patcher})()
    def forward(self, x, sigma, **kwargs):
        s = sigma.view(-1, 1, 1, 1, 1)
        return 0.6 * torch.tanh(x) - 0.3 * s * x + 0.1 * torch.sin(3 * x)

out = {}
for shift in (1.0, 3.0, 8.0):
    sampling = flow(shift)
    for scheduler in ("simple", "normal", "beta", "sgm_uniform", "karras"):
        for steps in (1, 4, 13):
            out[f"sigmas_{scheduler}_{shift}_{steps}"] = comfy.samplers.calculate_sigmas(sampling, scheduler, steps)
sampling = flow(3.0)
x = torch.randn((2, 3, 2, 4, 4), generator=torch.Generator().manual_seed(5))
for scheduler in ("simple", "karras"):
    sigmas = comfy.samplers.calculate_sigmas(sampling, scheduler, 6)
    start = sampling.noise_scaling(sigmas[0], x, torch.zeros_like(x))
    for name in ("euler", "euler_ancestral", "dpmpp_2m", "lcm"):
        function = getattr(k, f"sample_{name}")
        out[f"run_{name}_{scheduler}"] = function(Toy(sampling), start.clone(), sigmas, extra_args={"seed": 77},
                                                  disable=True)
    longer = comfy.samplers.calculate_sigmas(sampling, scheduler, 7)  # KSampler's schedule for uni_pc
    dropped = torch.cat([longer[:-2], longer[-1:]])
    out[f"sigmas_uni_pc_{scheduler}"] = dropped.clone()
    out[f"run_uni_pc_{scheduler}"] = uni_pc.sample_unipc(Toy(sampling), start.clone(), dropped, extra_args={}, disable=True)
    out[f"last_sigma_uni_pc_{scheduler}"] = dropped[-1:].clone()
    for steps in (1, 2):  # the shortest runs: one step makes the first model call and no update
        longer = comfy.samplers.calculate_sigmas(sampling, scheduler, steps + 1)
        short = torch.cat([longer[:-2], longer[-1:]])
        start_short = sampling.noise_scaling(short[0], x, torch.zeros_like(x))
        out[f"run_uni_pc_{scheduler}_{steps}"] = uni_pc.sample_unipc(Toy(sampling), start_short.clone(), short,
                                                                    extra_args={}, disable=True)
save_file({key: value.contiguous() for key, value in out.items()}, out_file)
"""


@pytest.fixture(scope="module")
def native(recent_comfyui_dir: Path, tmp_path_factory) -> dict[str, torch.Tensor]:
    out_file = tmp_path_factory.mktemp("native") / "native.safetensors"
    done = subprocess.run([sys.executable, "-c", NATIVE, str(out_file)], cwd=recent_comfyui_dir, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return load_file(str(out_file))


def toy_denoise(index: int, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    return 0.6 * torch.tanh(x) - 0.3 * sigma * x + 0.1 * torch.sin(3 * x)


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_every_schedule_equals_comfyuis(native, scheduler) -> None:
    for shift in SHIFTS:
        for steps in STEP_COUNTS:
            ours, theirs = schedule(scheduler, steps, shift), native[f"sigmas_{scheduler}_{shift}_{steps}"]
            assert ours.shape == theirs.shape and torch.equal(ours, theirs), (scheduler, shift, steps, ours, theirs)


def test_denoise_and_step_ranges_cut_the_schedule_as_ksampler_does() -> None:
    full = schedule("simple", 10, 3.0)
    assert torch.equal(run_sigmas("simple", 4, 3.0, denoise=0.4), full[-5:])  # the last 4 of int(4 / 0.4) = 10
    assert torch.equal(run_sigmas("simple", 10, 3.0, start_step=3, end_step=7), full[3:8])
    assert len(run_sigmas("simple", 10, 3.0, start_step=10)) == 1  # nothing left to run


@pytest.mark.parametrize("name", COMFY_SAMPLERS)
@pytest.mark.parametrize("scheduler", ["simple", "karras"])
def test_every_sampler_equals_comfyuis_on_a_toy_flow_model(native, name, scheduler) -> None:
    if name == "uni_pc":  # one step longer, the next-to-last sigma dropped; its final 0 becomes 0.001, as ComfyUI's
        sigmas = run_sigmas(scheduler, 6, 3.0, discard_penultimate=True)
        assert torch.equal(sigmas, native[f"sigmas_uni_pc_{scheduler}"])
    else:
        sigmas = schedule(scheduler, 6, 3.0)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    start = sigmas[0] * x
    start = schedule(scheduler, 6, 3.0)[0] * x if name == "uni_pc" else start
    ours = solve(name, toy_denoise, start.clone(), sigmas, ancestral_noise(SEED, SHAPE, range(SHAPE[0]), "cpu"))
    theirs = native[f"run_{name}_{scheduler}"]
    if name == "uni_pc":
        assert torch.equal(sigmas[-1:], native[f"last_sigma_uni_pc_{scheduler}"])
    difference = (ours - theirs).abs().max().item()
    assert difference <= TOLERANCE, f"{name}/{scheduler}: {difference:.3g} from ComfyUI's"
    assert (ours - start).abs().max() > 0.1, "the run must move the latent for the comparison to mean anything"


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("scheduler", ["simple", "karras"])
def test_the_shortest_uni_pc_runs_equal_comfyuis(native, scheduler, steps) -> None:
    """One step of ComfyUI's uni_pc ends before its first update (its loop only makes the first model call); two
    steps are one predictor-corrector step and a last predictor step."""
    sigmas = run_sigmas(scheduler, steps, 3.0, discard_penultimate=True)
    x = torch.randn(SHAPE, generator=torch.Generator().manual_seed(5))
    start = sigmas[0] * x
    ours = solve("uni_pc", toy_denoise, start.clone(), sigmas, lambda: None)
    theirs = native[f"run_uni_pc_{scheduler}_{steps}"]
    difference = (ours - theirs).abs().max().item()
    assert difference <= TOLERANCE, f"uni_pc/{scheduler}/{steps} steps: {difference:.3g} from ComfyUI's"
