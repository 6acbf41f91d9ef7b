"""One transformer call for a sampler that runs in the driver's process; runs in the workers.

ComfyUI's own samplers (KSampler and the rest) drive the WanMesh MODEL: they own the schedule, the noise and the
guidance, and each of their model calls becomes one ``protocol.ModelForward``. Here a rank turns its share of the
rows (model input, timestep, text, VACE context) into flow predictions with the resident transformer and its
parallel plans, exactly as the worker-side loop calls the model.
"""

from __future__ import annotations

import torch

from ..protocol import ModelForward
from ..vace.context import default_vace_context
from .guidance import flow_prediction
from .latents import LATENTS_MEAN, LATENTS_STD


def vace_call_inputs(contexts: torch.Tensor, strengths: list[float], layer_count: int, dtype, device) -> dict:
    """The keyword arguments that feed normalised VACE contexts [B, N, 96, T, h, w] to diffusers' VACE transformer:
    one context takes its single-context form (one scale per VACE layer), several the multi-context form."""
    contexts = contexts.to(device=device, dtype=dtype)
    if len(strengths) == 1:
        scale = torch.full((layer_count,), float(strengths[0]), device=device, dtype=dtype)
        return {"control_hidden_states": contexts[:, 0], "control_hidden_states_scale": scale}
    return {"control_hidden_states": contexts,
            "control_hidden_states_scale": torch.tensor([float(s) for s in strengths], device=device, dtype=dtype)}


def vace_layers_of(model, given_contexts: bool) -> list[int] | None:
    """The model's VACE layers; None for a model without VACE blocks, which refuses VACE contexts."""
    vace_layers = getattr(getattr(model, "config", None), "vace_layers", None)
    if vace_layers is None and given_contexts:
        raise ValueError("the conditioning carries VACE contexts but the model has no VACE blocks; load a VACE model "
                         "(or a T2V model with a VACE module), or sample without VACE conditioning")
    return vace_layers


def forward_vace_inputs(model, request: ModelForward, rows: range, dtype, device) -> dict:
    """VACE inputs of a model call: the given contexts, or the native default (zero latents, ones mask) for a VACE
    model called without them; none for a model without VACE blocks (which refuses VACE contexts)."""
    vace_layers = vace_layers_of(model, request.vace_context is not None)
    if vace_layers is None:
        return {}
    if request.vace_context is None:
        _, _, frames, h, w = request.latent.shape
        contexts = default_vace_context(len(rows), frames, h, w, LATENTS_MEAN.flatten(), LATENTS_STD.flatten())
        return vace_call_inputs(contexts, [1.0], len(vace_layers), dtype, device)
    contexts = request.vace_context[rows.start : rows.stop]
    return vace_call_inputs(contexts, request.vace_strengths, len(vace_layers), dtype, device)


def forward_rows(model, request: ModelForward, rows: range, dtype, device) -> torch.Tensor:
    """The flow prediction [len(rows), 16, T, h, w] (float32, CPU) of the given rows of a model call."""
    latents = request.latent[rows.start : rows.stop].to(device=device, dtype=dtype)
    timestep = request.timestep[rows.start : rows.stop].to(device)
    context = request.context[rows.start : rows.stop].to(device=device, dtype=dtype)
    extra = forward_vace_inputs(model, request, rows, dtype, device)
    return flow_prediction(model, latents, timestep, context, extra).float().cpu()
