"""The WanMesh Pool node's ``previews`` switch reaches the sampler's request (no ComfyUI, no worker pool).

The pool node is run with the pool start replaced by a recorder, and the sampler node with ComfyUI's progress
bar and interrupt check replaced by stand-ins, so what is checked is the request the sampler would send.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from wanmesh.nodes.bridge.convert import embeddings_to_conditioning
from wanmesh.nodes.pool import WanMeshPool
from wanmesh.nodes.bridge.runtime import ResidentModel
from wanmesh.nodes.sampling import WanMeshSampler
from wanmesh.parallel.config import latent_shape
from wanmesh.parallel.protocol import Latents
from wanmesh.parallel.driver import runner as runner_module
from wanmesh.parallel.sampling.loop import pad_to_wan_text_length

POOL_INPUTS = dict(devices="cpu:2", world=2, tp=1, ulysses=1, ring=1, cfg_parallel=False, vae_patch=1,
                   backend="local", ray_address="")


class RecordingPool:
    """Stands in for a started worker pool: keeps the requests it is sent and answers with zero latents."""

    closed = False

    def __init__(self, config, **options):
        self.config = config
        self.requests = []

    def call(self, request, progress=None, should_cancel=None):
        self.requests.append(request)
        return Latents(torch.zeros_like(request.latent))


@pytest.fixture()
def comfy_stubs(monkeypatch):
    """ComfyUI's comfy.utils.ProgressBar and comfy.model_management, reduced to what the sampler node calls."""
    comfy = types.ModuleType("comfy")
    comfy.utils = types.ModuleType("comfy.utils")
    comfy.utils.ProgressBar = lambda total: types.SimpleNamespace(update_absolute=lambda *args: None)
    comfy.model_management = types.ModuleType("comfy.model_management")
    comfy.model_management.processing_interrupted = lambda: False
    comfy.model_management.throw_exception_if_processing_interrupted = lambda: None
    for name, module in (("comfy", comfy), ("comfy.utils", comfy.utils),
                         ("comfy.model_management", comfy.model_management)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(runner_module, "get_pool", RecordingPool)


def sampled_request(**pool_inputs):
    (runner,) = WanMeshPool().make(**POOL_INPUTS, **pool_inputs)
    text = embeddings_to_conditioning([pad_to_wan_text_length(torch.randn(3, 64))])
    WanMeshSampler().sample(ResidentModel(runner, "model|tiny"), text, text,
                            {"samples": torch.zeros(latent_shape(64, 48, 5))}, seed=1, steps=2, cfg=5.0, shift=3.0,
                            sampler_name="unipc", denoise=1.0)
    (request,) = runner.pool.requests
    return request


def test_previews_input_is_an_optional_switch_on_by_default():
    spec = WanMeshPool.INPUT_TYPES()["optional"]["previews"]
    assert spec[0] == "BOOLEAN" and spec[1]["default"] is True and spec[1]["tooltip"]


def test_pool_node_previews_switch_decides_whether_the_sampler_asks_for_previews(comfy_stubs):
    assert sampled_request(previews=False).preview is False
    assert sampled_request(previews=True).preview is True
    assert sampled_request().preview is True  # prompts written before the input existed keep previews on
