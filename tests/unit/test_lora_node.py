"""The LoRA loader node's ComfyUI side: chained loaders build the ordered LoRA list, the sampler node sends it with
the model's handle, and a LoRA that does not fit the model fails at the loader, before any pool work. ComfyUI's
modules are stubbed; the runner is a recording stand-in."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from safetensors.torch import save_file

from wanmesh.parallel import protocol as P
from wanmesh.nodes.bridge.runtime import ResidentModel


class RecordingRunner:
    def __init__(self):
        self.requests = []

    def sample_reply(self, request, progress=None, should_stop=None):
        self.requests.append(request)
        return P.Latents(torch.zeros_like(request.latent))


@pytest.fixture()
def comfy_stubs(tiny_models, monkeypatch):
    folder_paths = types.ModuleType("folder_paths")
    loras = tiny_models["lora_comfy"].parent
    folder_paths.folder_names_and_paths = {"loras": ([str(loras)], {".safetensors"})}
    folder_paths.get_filename_list = lambda name: sorted(p.name for p in loras.iterdir())
    folder_paths.get_full_path = lambda name, file: str(loras / file) if (loras / file).is_file() else None
    comfy = types.ModuleType("comfy")
    comfy.utils = types.ModuleType("comfy.utils")
    comfy.utils.ProgressBar = lambda total: types.SimpleNamespace(update_absolute=lambda *a: None)
    comfy.model_management = types.ModuleType("comfy.model_management")
    comfy.model_management.processing_interrupted = lambda: False
    for name, module in (("folder_paths", folder_paths), ("comfy", comfy), ("comfy.utils", comfy.utils),
                         ("comfy.model_management", comfy.model_management)):
        monkeypatch.setitem(sys.modules, name, module)
    return loras


def test_chained_loaders_send_the_ordered_list_with_the_sample(comfy_stubs, tiny_models):
    from wanmesh.nodes.lora import WanMeshLoraLoader
    from wanmesh.nodes.sampling import WanMeshSampler

    runner = RecordingRunner()
    handle = f"model|{tiny_models['t2v']}||torch.float32|keep"
    model = ResidentModel(runner, handle, path=str(tiny_models['t2v']))
    spec = WanMeshLoraLoader.INPUT_TYPES()["required"]
    assert "wan_tiny_lora_peft.safetensors" in spec["lora_name"][0]
    assert (spec["strength"][1]["min"], spec["strength"][1]["max"], spec["strength"][1]["default"]) == (-100, 100, 1.0)  # native LoraLoaderModelOnly's range
    (first,) = WanMeshLoraLoader().load(model, "wan_tiny_lora_comfy.safetensors", 0.8)
    (second,) = WanMeshLoraLoader().load(first, "wan_tiny_lora_peft.safetensors", -0.5)
    assert model.loras == () and first.loras == ((str(comfy_stubs / "wan_tiny_lora_comfy.safetensors"), 0.8),)
    assert [strength for _, strength in second.loras] == [0.8, -0.5] and second.handle == handle

    conditioning = [[torch.randn(1, 5, 64), {}]]
    WanMeshSampler().sample(second, conditioning, conditioning, {"samples": torch.zeros(1, 16, 2, 4, 4)},
                            seed=1, steps=2, cfg=4.0, shift=3.0, sampler_name="unipc", denoise=1.0)
    (request,) = runner.requests
    assert request.model_loras == {handle: list(second.loras)}


def test_a_lora_for_another_model_fails_at_the_loader(comfy_stubs, tiny_models):
    from wanmesh.nodes.lora import WanMeshLoraLoader

    save_file({"diffusion_model.blocks.0.self_attn.q.lora_up.weight": torch.ones(5120, 4),
               "diffusion_model.blocks.0.self_attn.q.lora_down.weight": torch.ones(4, 5120)},
              str(comfy_stubs / "other_model_lora.safetensors"))
    try:
        model = ResidentModel(RecordingRunner(), f"model|{tiny_models['t2v']}||torch.float32|keep",
                              path=str(tiny_models['t2v']))
        with pytest.raises(ValueError, match="does not fit this model") as error:
            WanMeshLoraLoader().load(model, "other_model_lora.safetensors", 1.0)
        assert "\n" not in str(error.value)
    finally:
        (comfy_stubs / "other_model_lora.safetensors").unlink()
