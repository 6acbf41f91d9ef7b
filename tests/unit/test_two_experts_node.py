"""The sampler node's two-expert inputs: the request it builds (ComfyUI's "10000 = to the end", -1 = the same
cfg), the step report it logs, old workflows' calls without the new inputs, and experts from two different
pools refused before any pool work. The pool is a recording stand-in and ComfyUI's progress bar a stub."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from wanmesh.nodes.bridge.runtime import ResidentModel
from wanmesh.nodes.sampling import WanMeshSampler
from wanmesh.parallel import protocol as P


class RecordingRunner:
    def __init__(self):
        self.pool = object()
        self.requests: list[P.SampleRequest] = []

    def sample_reply(self, request, progress=None, should_stop=None):
        request.validate()
        self.requests.append(request)
        return P.Latents(request.latent + 1, expert_steps="high-noise expert: steps 0-1, low-noise expert: steps 2-5")


@pytest.fixture(autouse=True)
def comfy_stubs(monkeypatch):
    """Just enough of ComfyUI for the node: a progress bar and the interrupt flag."""
    comfy = types.ModuleType("comfy")
    utils = types.ModuleType("comfy.utils")
    utils.ProgressBar = lambda total: types.SimpleNamespace(update_absolute=lambda *a: None)
    management = types.ModuleType("comfy.model_management")
    management.processing_interrupted = lambda: False
    comfy.utils, comfy.model_management = utils, management
    for name, module in (("comfy", comfy), ("comfy.utils", utils), ("comfy.model_management", management)):
        monkeypatch.setitem(sys.modules, name, module)


def _conditioning():
    return [[torch.randn(1, 7, 64), {"pooled_output": None}]]


def _sample(runner, **optional):
    high = ResidentModel(runner, "model|high")
    latent = {"samples": torch.zeros(1, 16, 2, 6, 8)}
    return WanMeshSampler().sample(high, _conditioning(), _conditioning(), latent, 3, 6, 5.0, 3.0, "euler", 1.0,
                                   **optional)


def test_node_builds_a_two_expert_request_and_logs_the_steps(caplog):
    runner = RecordingRunner()
    low = ResidentModel(runner, "model|low")
    with caplog.at_level(logging.INFO):
        (latent,) = _sample(runner, model_low_noise=low, boundary=0.9, cfg_low_noise=-1.0, start_step=0,
                            end_step=10000, add_noise=True)
    (request,) = runner.requests
    assert (request.handle, request.handle_low, request.boundary) == ("model|high", "model|low", 0.9)
    assert request.guidance_scale_low is None and request.end_step is None and request.add_noise
    assert torch.equal(latent["samples"], torch.ones(1, 16, 2, 6, 8))
    assert "high-noise expert: steps 0-1, low-noise expert: steps 2-5" in caplog.text


def test_node_passes_a_chained_second_sampler_as_comfyui_would():
    runner = RecordingRunner()
    _sample(runner, cfg_low_noise=2.5, start_step=2, end_step=4, add_noise=False)
    (request,) = runner.requests
    assert (request.start_step, request.end_step, request.add_noise, request.guidance_scale_low) == (2, 4, False, 2.5)
    assert request.handle_low is None


def test_workflows_saved_before_the_new_inputs_still_sample():
    runner = RecordingRunner()
    _sample(runner)
    (request,) = runner.requests
    assert (request.handle_low, request.start_step, request.end_step, request.add_noise) == (None, 0, None, True)


def test_experts_in_different_pools_and_bad_ranges_are_refused_before_pool_work():
    runner, other = RecordingRunner(), RecordingRunner()
    with pytest.raises(ValueError, match="loaded in different worker pools"):
        _sample(runner, model_low_noise=ResidentModel(other, "model|low"))
    with pytest.raises(ValueError, match="start_step=4, end_step=3 is not valid for 6 steps"):
        _sample(runner, start_step=4, end_step=3)
    assert runner.requests == [] and other.requests == []
