"""The LoRA loader node: adds a LoRA (file, strength) to a resident model's list; the workers merge it when sampling."""

from __future__ import annotations

import dataclasses

from ..parallel import check_lora_for_model
from ..parallel.validation import check_lora_values
from ..parallel.fields import node_input
from .bridge.files import model_path

CATEGORY = "WanMesh/loaders"


def _lora_files() -> list[str]:
    import folder_paths

    return sorted(folder_paths.get_filename_list("loras"))


class WanMeshLoraLoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": ("WANMESH_MODEL", {"tooltip": "the loaded Wan model (or the output of another LoRA loader)"}),
                "lora_name": (_lora_files(), {"tooltip": "LoRA file from ComfyUI's loras folder (ComfyUI, PEFT/"
                                                          "diffusers, kohya or diff format)"}),
                "strength": node_input("lora_strength"),
            },
        }

    RETURN_TYPES = ("WANMESH_MODEL",)
    FUNCTION = "load"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Applies a LoRA to a WanMesh model; chain several. The LoRA is merged into the workers' "
                   "(tensor-parallel sharded) weights when the sampler runs and taken out again, from the model "
                   "file, when the LoRAs change. The file's header is checked against the model here.")

    def load(self, model, lora_name, strength):
        path = model_path("loras", lora_name)
        check_lora_for_model(path, model.model_files())
        check_lora_values(path, f"lora_name {lora_name}:")
        return (dataclasses.replace(model, loras=(*model.loras, (path, float(strength)))),)
