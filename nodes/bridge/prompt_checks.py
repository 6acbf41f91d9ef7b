"""The files of a queued prompt checked against each other before anything loads; runs in the ComfyUI process.

In a graph the model, the VAE and the text encoder never meet in one node: the VAE decodes the sampler's output,
the text encoder feeds the sampler through a Text Encode. So each WanMesh loader takes ComfyUI's hidden ``PROMPT``
input (the API prompt being run) and, before it loads its file, finds in it every node that uses a model from a
WanMesh Model Loader, the VAEs of the WanMesh VAE Loaders used upstream of that node (a Wan 2.2 TI2V latent, an
image-to-video encode), by it or downstream of it (the decode), and the text encoders of the WanMesh Text Encoder
Loaders upstream of it. Each (model, VAE, text encoder) is checked by ``validation.check_model_partners``, the
check the command line runs, from the headers. The first WanMesh loader that runs refuses a mismatch in one line
naming both files, so no worker loads weights for a prompt that cannot run.
"""

from __future__ import annotations

from collections.abc import Iterator

from ...parallel.validation import check_model_partners
from .files import model_path

# Loader class -> (its file input, the models folder that input names a file of).
LOADERS = {"WanMeshModelLoader": ("model_name", "diffusion_models"), "WanMeshVAELoader": ("vae_name", "vae"),
           "WanMeshTextEncoderLoader": ("text_encoder_name", "text_encoders")}
MODEL_INPUTS = ("model", "model_low_noise")  # followed back through pass-through nodes (LoRA loaders)
HIDDEN_PROMPT = {"hidden": {"prompt": "PROMPT"}}  # added to the loaders' INPUT_TYPES


def _link(value) -> str | None:
    """The source node id of a linked input ([node id, output index]), else None (a widget value)."""
    return str(value[0]) if isinstance(value, list) and len(value) == 2 and isinstance(value[1], int) else None


def _loader_file(prompt: dict, node_id: str | None, loader: str) -> tuple[str, str] | None:
    """(file path, the input that named it) of the ``loader`` node ``node_id``; None for another node."""
    node = prompt.get(node_id) if node_id is not None else None
    if node is None or node.get("class_type") != loader:
        return None
    name_input, folder = LOADERS[loader]
    name = node.get("inputs", {}).get(name_input)
    if not isinstance(name, str):
        return None
    try:
        return model_path(folder, name), f"{name_input}"
    except (OSError, ValueError):
        return None  # a file the loader itself will refuse, naming it


def _model_file(prompt: dict, node_id: str | None, seen: frozenset = frozenset()) -> str | None:
    """The transformer file feeding node ``node_id``'s model, through pass-through nodes with a model input."""
    node = prompt.get(node_id) if node_id is not None else None
    if node is None or node_id in seen:
        return None
    found = _loader_file(prompt, node_id, "WanMeshModelLoader")
    if found is not None:
        return found[0]
    return _model_file(prompt, _link(node.get("inputs", {}).get("model")), seen | {node_id})


def _upstream(prompt: dict, node_id: str, skip: tuple[str, ...] = ()) -> set[str]:
    """Every node ``node_id`` reads from, directly or not, except through the inputs named in ``skip``."""
    found: set[str] = set()
    stack = [_link(value) for name, value in prompt[node_id].get("inputs", {}).items() if name not in skip]
    while stack:
        source = stack.pop()
        if source is None or source in found or source not in prompt:
            continue
        found.add(source)
        stack.extend(_link(value) for value in prompt[source].get("inputs", {}).values())
    return found


def _downstream(prompt: dict, node_id: str) -> set[str]:
    """Every node that reads ``node_id``'s outputs, directly or not."""
    found: set[str] = set()
    stack = [node_id]
    while stack:
        current = stack.pop()
        for key, node in prompt.items():
            if key not in found and any(_link(value) == current for value in node.get("inputs", {}).values()):
                found.add(key)
                stack.append(key)
    return found


def _partners(prompt: dict, node_ids: set[str], input_name: str, loader: str) -> set[tuple[str, str]]:
    return {found for key in node_ids
            if (found := _loader_file(prompt, _link(prompt[key].get("inputs", {}).get(input_name)), loader))}


def model_partners(prompt: dict) -> Iterator[tuple[tuple[str, str], tuple[str, str] | None, tuple[str, str] | None]]:
    """Each (model file, VAE, text encoder) used together in ``prompt``, each as (file, the input naming it)."""
    seen = set()
    for node_id, node in prompt.items():
        for model_input in MODEL_INPUTS:
            model = _model_file(prompt, _link(node.get("inputs", {}).get(model_input)))
            if model is None:
                continue
            upstream = _upstream(prompt, node_id, skip=MODEL_INPUTS)
            vaes = _partners(prompt, upstream | {node_id} | _downstream(prompt, node_id), "vae", "WanMeshVAELoader")
            encoders = _partners(prompt, upstream | {node_id}, "text_encoder", "WanMeshTextEncoderLoader")
            for vae in vaes or {None}:
                for text_encoder in encoders or {None}:
                    if (model, vae, text_encoder) not in seen and (vae or text_encoder):
                        seen.add((model, vae, text_encoder))
                        yield (model, "model_name"), vae, text_encoder


def check_prompt_files(prompt: dict | None) -> None:
    """Refuse a prompt whose WanMesh model, VAE and text encoder do not fit together (one line naming both files);
    nothing without a prompt (a loader called outside ComfyUI's executor)."""
    if not isinstance(prompt, dict):
        return
    for (model, model_flag), vae, text_encoder in model_partners(prompt):
        check_model_partners(model, model_flag, vae=vae, text_encoder=text_encoder)
