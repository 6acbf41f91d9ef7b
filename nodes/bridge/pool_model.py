"""ComfyUI's MODEL type over a transformer resident in the worker pool; runs in the ComfyUI process.

ComfyUI's samplers (KSampler, KSamplerAdvanced, SamplerCustom(Advanced), the guiders, sigma and model-sampling
nodes) drive a ``ModelPatcher`` around a ``BaseModel``. The BaseModel here is ComfyUI's own Wan model class (WAN22
with the Wan 2.2 latent format for the 48-channel TI2V 5B, whose noise mask ComfyUI turns into per-frame
timesteps; WAN21_Camera for a Wan 2.1 or 2.2 Fun Camera file, whose conditioning delivers WanCameraImageToVideo's camera
embedding), so its latent format, flow model sampling (shift 8, or what ModelSamplingSD3 sets), conditioning and
VACE context code are ComfyUI's; only its transformer is replaced by ``PoolTransformer``, whose every call is one
``ModelForward`` on the pool. A call that batches conditional and unconditional rows goes out as one request,
and the pool's CFG-parallel ranks split the rows; on a pool of layout auto the first call of each latent size
chooses the layout. ComfyUI's progress bar, latent previews and interrupt work as with a native model (the
interrupt also stops a model call that is under way). ComfyUI's LoRA loaders, wrappers and block replacements on
this MODEL follow ``pool_patches.py``.

The classes subclass ComfyUI's, so they are made on first use (``comfy`` is imported only then).
"""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import torch

from ...parallel import Cancelled, ModelForward, has_vace_blocks, model_image_inputs
from ...parallel.config import LATENT_CHANNELS, WAN22_LATENT_CHANNELS
from ...parallel.weights.detect import FUN22_CAMERA_IN_CHANNELS
from .conditioning_keys import NATIVE_WAN_CLASSES, UNSUPPORTED_INPUTS, check_family_keys, model_input_refusal
from .convert import with_reference_audio
from .pool_patches import (POOL_LORAS, add_lora_patches, check_model_patches, drop_torch_compile,
                           native_weight_shapes, skipped_blocks)
from .runtime import ResidentModel, arrange, auto_layout_of, interrupted, raise_if_interrupted

log = logging.getLogger("wanmesh")

MERGE_REFUSAL = ("model merging (ModelMerge*, model key patches) cannot read a WanMesh MODEL's weights (they live in "
                 "the worker pool); merge the files beforehand and load the result")


POOL_BLOCK_LISTS = ("blocks", "vace_blocks")
BLOCKS_IN_THE_POOL = ("the WanMesh MODEL's transformer blocks run in the worker pool, so a node that reaches into "
                      "them (LoraLoaderBypass / LoraLoaderBypassModelOnly, ...) cannot run on it; load LoRAs with "
                      "LoraLoaderModelOnly or the WanMesh LoRA Loader, or use a native model")


class PoolTransformer(torch.nn.Module):
    """Stands in for ComfyUI's WanModel inside its BaseModel: the same call signature, run on the pool."""

    def __init__(self, resident: ResidentModel, in_channels: int = LATENT_CHANNELS, cache: dict | None = None,
                 humo: bool = False):
        super().__init__()
        self.resident = resident
        self.humo = humo  # HuMo: its reference latent is appended in time (not Wan 2.2 Fun's ref_conv input)
        self.cache = cache  # step-caching settings (WanMesh Cache), run in the workers over a sampler run's calls
        self.dtype = torch.float32  # ComfyUI casts the model input and the text to this before calling
        # ComfyUI's Wan conditioning reads the input width from the patch embedding (for image-to-video channels)
        self.patch_embedding = SimpleNamespace(weight=SimpleNamespace(shape=(0, in_channels, 1, 2, 2)))

    def __getattr__(self, name: str):
        """nn.Module's attribute lookup, except that reaching for the blocks (ComfyUI's bypass LoRA loaders look
        each adapted layer up by name) stops the node in one line instead of finding nothing and doing nothing."""
        if name in POOL_BLOCK_LISTS:
            raise ValueError(BLOCKS_IN_THE_POOL)
        return super().__getattr__(name)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        """ComfyUI's Wan weight names, each with an empty tensor (their shapes are in the file's header): what its
        LoRA key map reads; the pool holds the weights, so the MODEL's size here stays 0."""
        for name in native_weight_shapes(tuple(self.resident.model_files())) or ():
            destination[prefix + name] = torch.empty(0, device="meta")

    def forward(self, x, timestep, context, clip_fea=None, time_dim_concat=None, transformer_options=None, **extra):
        """As ComfyUI's WanModel.forward: its DIFFUSION_MODEL wrappers (EasyCache) run here around each pool call."""
        import comfy.patcher_extension as extension

        options = transformer_options if transformer_options is not None else {}
        wrappers = extension.get_all_wrappers(extension.WrappersMP.DIFFUSION_MODEL, options)
        return extension.WrapperExecutor.new_class_executor(self._forward, self, wrappers).execute(
            x, timestep, context, clip_fea, time_dim_concat, options, **extra)

    def _forward(self, x, timestep, context, clip_fea=None, time_dim_concat=None, transformer_options=None,
                 control=None, **extra):
        check_supported_inputs(control, extra)
        options = transformer_options or {}
        frames = x.shape[2]
        if self.humo:  # HuMo's reference: the frames after the video's (ComfyUI's HumoWanModel appends them)
            time_dim_concat, extra = extra.get("reference_latent"), {**extra, "reference_latent": None}
            extra["audio_embed"] = humo_audio(extra.get("audio_embed"), time_dim_concat)
        x = with_time_concat(x, time_dim_concat, timestep)
        self._arrange_for_call(x, options)
        request = ModelForward(
            handle=self.resident.handle, latent=x.detach().float().cpu(), timestep=call_timesteps(timestep, x),
            context=context.detach().float().cpu(), loras=[*self.resident.loras, *options.get(POOL_LORAS, ())],
            clip_fea=None if clip_fea is None else clip_fea.detach().float().cpu(), **vace_inputs(extra),
            **animate_inputs(extra),
            **camera_inputs(extra),
            skip_blocks=skipped_blocks(options), **cache_inputs(self.cache, timestep, options),
            reference_latent=reference_input(extra.get("reference_latent")),
            audio_embed=extra.get("audio_embed"),
        )
        try:
            prediction = self.resident.runner.forward(request, should_stop=interrupted)
        except Cancelled:
            raise_if_interrupted()
            raise
        return prediction[:, :, :frames].to(device=x.device, dtype=x.dtype)

    def _arrange_for_call(self, x: torch.Tensor, transformer_options: dict) -> None:
        """With a Pool node on layout auto, ComfyUI's samplers show the job one model call at a time: the first
        call with a latent of this size chooses the layout (rows sent as conditional and unconditional passes
        mean guidance; the steps are the sampler's sigmas), and later calls of that size on the same pool keep
        it, so a sampling run never restarts the pool between steps."""
        if not auto_layout_of(self.resident):
            return
        runner, key = self.resident.runner, (self.resident.path, tuple(x.shape[1:]))
        if key in runner.call_layouts:
            runner.arrange(runner.call_layouts[key])  # nothing to do unless another job rearranged the pool
            return
        from ...parallel.auto_layout import Job

        passes = len(transformer_options.get("cond_or_uncond") or (0,))
        sigmas = transformer_options.get("sample_sigmas")
        job = Job.of_latent(x.shape, steps=len(sigmas) - 1 if sigmas is not None else Job.steps,
                            batch=max(1, x.shape[0] // passes), guidance=passes > 1)
        runner.call_layouts[key] = arrange(self.resident, job, caller="Native Model: ")


def cache_inputs(cache: dict | None, timestep: torch.Tensor, transformer_options: dict) -> dict:
    """The ModelForward fields of a step cache: its settings and the call's step among the sampler's sigmas (the
    nearest one; none when ComfyUI gives no sigmas, and the workers count steps by timestep)."""
    if cache is None:
        return {}
    sigmas = transformer_options.get("sample_sigmas")
    if sigmas is None or len(sigmas) < 2:
        return {"cache": cache}
    sigma = float(timestep.detach().float().reshape(-1).max()) / 1000.0
    step = int((sigmas[:-1].detach().float().cpu() - sigma).abs().argmin())
    return {"cache": cache, "cache_step": step, "cache_steps": len(sigmas) - 1}


def call_timesteps(timestep: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """ComfyUI's timestep of a call as ModelForward carries it: one per row [B], or, from WAN22's
    ``process_timestep`` with a noise mask (``denoise_mask``), one per row and latent frame [B, T]."""
    timestep = timestep.detach().float().cpu()
    if timestep.ndim == 2:
        return timestep.clone()
    return timestep.reshape(-1).expand(x.shape[0]).clone()


# The model inputs ComfyUI's Wan model classes give the transformer that the pool takes (the functions below), and
# those it needs no part in (WAN22's noise mask, already in the timesteps; the text of a ControlNet, refused with
# its control). Any other input stops the call: a new node's input is never dropped without a word.
POOL_INPUTS = frozenset({"vace_context", "vace_strength", "pose_latents", "face_pixel_values", "camera_conditions",
                         "audio_embed",
                         "reference_latent", "denoise_mask", "crossattn_controlnet", "y"})


def check_supported_inputs(control, extra: dict) -> None:
    """Refuse, in one line, conditioning the pool's transformer would otherwise silently ignore."""
    given = {"control": control, **extra}
    refused = [name for name in UNSUPPORTED_INPUTS if given.get(name) is not None]
    if refused:
        raise ValueError(model_input_refusal(refused[0]))
    unknown = sorted(name for name, value in extra.items() if value is not None and name not in POOL_INPUTS)
    if unknown:
        raise ValueError(f"the WanMesh MODEL does not take the model input {unknown[0]} (from a conditioning node "
                         "WanMesh does not run yet); sample without that node, or with native UNETLoader")


def reference_input(reference: torch.Tensor | None) -> torch.Tensor | None:
    """ComfyUI's ``reference_latent`` model input (Wan 2.2 Fun's reference image, normalised, one row per latent
    row) for ModelForward; the ranks run it through the model's ``ref_conv`` (or ignore it, as native, without)."""
    return None if reference is None else reference.detach().float().cpu()


def animate_inputs(extra: dict) -> dict:
    """The ModelForward fields of Wan 2.2 Animate's model inputs (WAN22_Animate's extra_conds: the normalised pose
    video latents and the face video's pixels)."""
    pairs = (("pose_latents", "pose_latents"), ("face_pixel_values", "face_pixels"))
    return {field: extra[name].detach().float().cpu() for name, field in pairs if extra.get(name) is not None}


def with_time_concat(x: torch.Tensor, time_dim_concat: torch.Tensor | None, timestep: torch.Tensor) -> torch.Tensor:
    """The model input with ComfyUI's ``time_dim_concat`` (Phantom's subject latents, normalised) after its frames,
    as ComfyUI's WanModel feeds them: the pool runs the longer latent (its RoPE and sequence split cover the added
    frames) and the caller keeps the prediction of the latent's own frames."""
    if time_dim_concat is None:
        return x
    concat = time_dim_concat.to(device=x.device, dtype=x.dtype)
    if concat.ndim != 5 or concat.shape[1] != x.shape[1] or concat.shape[3:] != x.shape[3:] or timestep.ndim > 1:
        raise ValueError(f"time_dim_concat {list(concat.shape)} cannot follow the model input {list(x.shape)}: it "
                         "needs the input's channels, height and width and one timestep per row "
                         "(WanPhantomSubjectToVideo on a text-to-video model, at the latent's size)")
    if concat.shape[0] != x.shape[0]:
        import comfy.utils

        concat = comfy.utils.repeat_to_batch_size(concat, x.shape[0])
    return torch.cat([x, concat], dim=2)


def humo_audio(audio_embed: torch.Tensor | None, reference: torch.Tensor | None) -> torch.Tensor | None:
    """HuMo's audio windows with a zero window for each of the reference's frames after them, as ComfyUI's
    HumoWanModel pads them (a count that then differs from the model input's frames is refused on the ranks)."""
    if audio_embed is None:
        return None
    return with_reference_audio(audio_embed.detach().float().cpu(), reference)


def vace_inputs(extra: dict) -> dict:
    """The ModelForward fields of ComfyUI's VACE model inputs (normalised contexts and their strengths)."""
    context = extra.get("vace_context")
    if context is None:
        return {}
    strengths = extra.get("vace_strength") or [1.0] * context.shape[1]
    return {"vace_context": context.detach().float().cpu(), "vace_strengths": [float(s) for s in strengths]}


def camera_inputs(extra: dict) -> dict:
    """The ModelForward field of ComfyUI's Fun Camera input (WAN21_Camera's camera_conditions); rows that are all
    alike (the conditional and unconditional passes of one WanCameraImageToVideo) go as one."""
    camera = extra.get("camera_conditions")
    if camera is None:
        return {}
    camera = camera.detach().float().cpu()
    if camera.shape[0] > 1 and all(torch.equal(camera[0], row) for row in camera[1:]):
        camera = camera[:1]
    return {"camera_conditions": camera}


class PoolMemory:
    """Mixed into each pool BaseModel class, before ComfyUI's Wan class: no memory reserved, other models' keys
    refused."""

    def memory_required(self, *args, **kwargs):
        # The transformer runs in the pool's processes, not here: ComfyUI needs no memory for it, and with
        # none reserved it batches the conditional and unconditional rows into one call.
        return 0

    def extra_conds(self, **kwargs):
        """ComfyUI's, after refusing a key of another Wan model's conditioning node (conditioning_keys.py)."""
        check_family_keys(kwargs, native_class_of(type(self)))
        return super().extra_conds(**kwargs)


@functools.cache
def pool_class(base_name: str):
    """ComfyUI's ``comfy.model_base.<base_name>`` with the pool's memory answers and key checks mixed in
    (``PoolMemory``); None for a ComfyUI without that class."""
    import comfy.model_base

    base = getattr(comfy.model_base, base_name, None)
    return None if base is None else type(f"Pool{base_name}", (PoolMemory, base), {})


@functools.cache
def comfy_classes():
    """(the BaseModel class for T2V, for VACE, for Wan 2.2 TI2V, the ModelPatcher class), made from the running
    ComfyUI's own (an older ComfyUI without WAN22 gets None for the last)."""
    import comfy.model_base
    import comfy.model_patcher

    if not hasattr(comfy.model_base, "WAN21_Vace"):
        raise ValueError("WanMesh Native Model needs a ComfyUI with native Wan and VACE support (2025 or newer); "
                         "update ComfyUI, or sample with the WanMesh Sampler")

    class PoolModelPatcher(comfy.model_patcher.ModelPatcher):
        """ComfyUI's weight patches go to the pool as LoRAs; patches it cannot run are refused (pool_patches.py)."""

        def add_patches(self, patches, strength_patch=1.0, strength_model=1.0):
            transformer = self.model.diffusion_model
            shapes = native_weight_shapes(tuple(transformer.resident.model_files()))
            return add_lora_patches(self, shapes, patches, strength_patch, strength_model)

        def get_key_patches(self, *args, **kwargs):
            raise ValueError(MERGE_REFUSAL)

        def add_wrapper_with_key(self, wrapper_type, key, wrapper):
            if not drop_torch_compile(wrapper_type, key):
                super().add_wrapper_with_key(wrapper_type, key, wrapper)

        def pre_run(self):
            check_model_patches(self)
            super().pre_run()

    return pool_class("WAN21"), pool_class("WAN21_Vace"), pool_class("WAN22"), PoolModelPatcher


def native_class_of(model_class: type) -> str:
    """The name of the ComfyUI Wan model class a pool BaseModel class is made from (its first such base)."""
    return next(base.__name__ for base in model_class.__mro__
                if base.__name__ in NATIVE_WAN_CLASSES and base.__module__ == "comfy.model_base")


def native_class_name(resident: ResidentModel) -> str:
    """The ComfyUI Wan model class ``pool_model`` makes for the resident's file (what its conditioning may hold)."""
    _, image_kind = model_image_inputs(resident.path)
    return _native_class_for(resident, image_kind)


def _native_class_for(resident: ResidentModel, image_kind: str | None) -> str:
    """``native_class_name`` given the file's ``detect.image_inputs`` kind."""
    if image_kind in IMAGE_KIND_CLASSES:
        return IMAGE_KIND_CLASSES[image_kind]
    return "WAN21_Vace" if has_vace_blocks(resident.model_files()) else "WAN21"


# ``detect.image_inputs`` kinds that ComfyUI runs with a model class of their own
IMAGE_KIND_CLASSES = {"first_frame": "WAN22", "animate": "WAN22_Animate", "camera": "WAN21_Camera",
                      "humo": "WAN21_HuMo"}


def pool_model(resident: ResidentModel, cache: dict | None = None):
    """ComfyUI's MODEL (a ModelPatcher) over the resident transformer, configured as ComfyUI configures a Wan model
    it loads itself (latent format, flow sampling with shift 8; an image-to-video model with its input channels, the
    Wan 2.1 I2V / FLF2V ones as image-to-video; Wan 2.2 TI2V 5B as WAN22 with the WAN22_T2V config, as ComfyUI's
    model detection sets them)."""
    import comfy.model_management

    *_, patcher = comfy_classes()
    in_channels, image_kind = model_image_inputs(resident.path)
    device = comfy.model_management.get_torch_device()
    class_name = _native_class_for(resident, image_kind)
    if class_name in MODEL_MAKERS:
        model = MODEL_MAKERS[class_name](in_channels, device)
    else:
        model = _wan21_model(class_name == "WAN21_Vace", in_channels, image_kind, device)
    model.diffusion_model = PoolTransformer(resident, in_channels, cache, humo=class_name == "WAN21_HuMo")
    return patcher(model, load_device=device, offload_device=comfy.model_management.unet_offload_device())


def _wan21_model(vace: bool, in_channels: int, image_kind: str | None, device):
    import comfy.supported_models

    wan, wan_vace, *_ = comfy_classes()
    takes_tokens = image_kind in ("clip_vision", "first_last")
    config_class = comfy.supported_models.WAN21_I2V if takes_tokens else comfy.supported_models.WAN21_T2V
    config = config_class({"image_model": "wan2.1", "in_dim": in_channels, "disable_unet_model_creation": True})
    return wan_vace(config, device=device) if vace else wan(config, image_to_video=takes_tokens, device=device)


def _family_model(family: str, since: str, base_name: str, config_name: str, model_type: str, in_channels: int,
                  device, extra_config: dict | None = None, **model_arguments):
    """ComfyUI's ``base_name`` model over the pool with the ``config_name`` config, as its model detection sets them
    for a ``family`` file; an older ComfyUI without them gets a one-line refusal naming the family."""
    import comfy.supported_models

    model_class, config_class = pool_class(base_name), getattr(comfy.supported_models, config_name, None)
    if model_class is None or config_class is None:
        raise ValueError(f"WanMesh Native Model needs a ComfyUI with {family} support ({since} or newer) for a "
                         f"{family} model; update ComfyUI, or sample with the WanMesh Sampler")
    config = config_class({"image_model": "wan2.1", "model_type": model_type, "in_dim": in_channels,
                           "disable_unet_model_creation": True, **(extra_config or {})})
    return model_class(config, device=device, **model_arguments)


def _animate_model(in_channels: int, device):
    """Wan 2.2 Animate: ComfyUI's WAN22_Animate model with the WAN22_Animate config."""
    return _family_model("Wan 2.2 Animate", "September 2025", "WAN22_Animate", "WAN22_Animate", "animate",
                         in_channels, device)


def _camera_model(in_channels: int, device):
    """Wan 2.1 and 2.2 Fun Camera: ComfyUI's WAN21_Camera (not image-to-video: Wan 2.1's start image latents fill
    the extra channels without a mask, Wan 2.2's 36 channels take the mask before them), with the config its model
    detection gives the file (WAN21_Camera, or WAN22_Camera for 36 input channels)."""
    wan22 = in_channels == FUN22_CAMERA_IN_CHANNELS
    return _family_model("Wan 2.2 Fun Camera" if wan22 else "Wan Fun Camera", "2025", "WAN21_Camera",
                         "WAN22_Camera" if wan22 else "WAN21_Camera", "camera_2.2" if wan22 else "camera",
                         in_channels, device, image_to_video=False)


def _wan22_model(in_channels: int, device):
    """Wan 2.2 TI2V 5B: ComfyUI's WAN22 model (image_to_video, as WAN22_T2V makes it) on the Wan22 latent format."""
    return _family_model("Wan 2.2", "July 2025", "WAN22", "WAN22_T2V", "t2v", in_channels, device,
                         {"out_dim": WAN22_LATENT_CHANNELS}, image_to_video=True)


def _humo_model(in_channels: int, device):
    """HuMo: ComfyUI's WAN21_HuMo model with the WAN21_HuMo config, as its model detection sets it."""
    return _family_model("HuMo", "2025", "WAN21_HuMo", "WAN21_HuMo", "humo", in_channels, device,
                         image_to_video=False)


MODEL_MAKERS = {"WAN22": _wan22_model, "WAN22_Animate": _animate_model, "WAN21_Camera": _camera_model,
                "WAN21_HuMo": _humo_model}
