"""Loader nodes: the transformer (T2V or VACE), the Wan VAE and the umT5 text encoder; runs in the ComfyUI process.

Each loader checks its file's header, then the prompt's files against each other (``prompt_checks.py``), before
it loads anything on the pool."""

from __future__ import annotations

from ..parallel import WEIGHT_MODES, check_model_file
from ..parallel.fields import node_input
from .bridge.files import list_models, list_vace_modules, model_path
from .bridge.prompt_checks import HIDDEN_PROMPT, check_prompt_files
from .bridge.runtime import ResidentModel, default_runner

DTYPE_CHOICES = node_input("dtype")
WEIGHTS_CHOICES = node_input("weights")
POOL_INPUT = {"pool": ("WANMESH_POOL", {"tooltip": "the worker pool to load on; none: the live pool, or one rank"})}
CATEGORY = "WanMesh/loaders"


def _runner(pool):
    return pool if pool is not None else default_runner()


class WanMeshModelLoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"model_name": (list_models("diffusion_models"), {"tooltip": "Wan T2V, VACE or image-to-video transformer file (.safetensors, .gguf) or diffusers folder"}),
                         "dtype": DTYPE_CHOICES},
            # Optional, after the older inputs: saved workflows and API prompts without ``weights`` load with keep.
            "optional": {"vace_module": (["none"] + list_vace_modules(), {"tooltip": "VACE module merged onto a T2V model; none: no VACE module"}),
                         "weights": WEIGHTS_CHOICES, **POOL_INPUT},
            **HIDDEN_PROMPT,
        }

    RETURN_TYPES = ("WANMESH_MODEL",)
    FUNCTION = "load"
    CATEGORY = CATEGORY
    DESCRIPTION = ("Loads a Wan 2.1 / 2.2 A14B transformer: T2V, VACE or image-to-video (I2V, FLF2V, Wan 2.2 I2V "
                   "experts); ComfyUI single file, fp8 and GGUF included, or diffusers folder.")

    def load(self, model_name, dtype, vace_module="none", weights=WEIGHT_MODES[0], pool=None, prompt=None):
        module = None if vace_module in (None, "none") else model_path("diffusion_models", vace_module)
        path = model_path("diffusion_models", model_name)
        check_model_file(path, "model", f"model_name {model_name}:", pool.config if pool is not None else None)
        if module is not None:
            check_model_file(module, "vace_module", f"vace_module {vace_module}:")
        check_prompt_files(prompt)
        runner = _runner(pool)
        handle = runner.load_model(path, vace_module=module, dtype=dtype, weights=weights)
        return (ResidentModel(runner, handle, path=path, vace_module=module),)


class WanMeshVAELoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"vae_name": (list_models("vae"), {"tooltip": "Wan 2.1 VAE file or diffusers folder"}),
                             "dtype": DTYPE_CHOICES}, "optional": POOL_INPUT, **HIDDEN_PROMPT}

    RETURN_TYPES = ("WANMESH_VAE",)
    FUNCTION = "load"
    CATEGORY = CATEGORY
    DESCRIPTION = "Loads the Wan 2.1 VAE into the worker pool (decode, encode and VACE encode run there)."

    def load(self, vae_name, dtype, pool=None, prompt=None):
        path = model_path("vae", vae_name)
        check_model_file(path, "vae", f"vae_name {vae_name}:")
        check_prompt_files(prompt)
        runner = _runner(pool)
        return (ResidentModel(runner, runner.load_vae(path, dtype=dtype), path=path, kind="vae"),)


class WanMeshTextEncoderLoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {"text_encoder_name": (list_models("text_encoders"), {"tooltip": "umT5-XXL file (ComfyUI format) or folder"}),
                         "dtype": DTYPE_CHOICES},
            "optional": POOL_INPUT,
            **HIDDEN_PROMPT,
        }

    RETURN_TYPES = ("WANMESH_TEXT_ENCODER",)
    FUNCTION = "load"
    CATEGORY = CATEGORY
    DESCRIPTION = "Loads the umT5 text encoder into the worker pool (tensor parallel with the pool's tp)."

    def load(self, text_encoder_name, dtype, pool=None, prompt=None):
        path = model_path("text_encoders", text_encoder_name)
        check_model_file(path, "text_encoder", f"text_encoder_name {text_encoder_name}:",
                         pool.config if pool is not None else None)
        check_prompt_files(prompt)
        runner = _runner(pool)
        return (ResidentModel(runner, runner.load_text_encoder(path, dtype=dtype), path=path, kind="text_encoder"),)
