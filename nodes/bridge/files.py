"""Model file lists and paths from ComfyUI's model folders: every name a kind has (today's and the 2024 one, e.g.
``diffusion_models`` and ``unet``) that this ComfyUI knows, so a file in any of their folders is listed and found."""

from __future__ import annotations

import functools
import os

FOLDER_ALIASES = {
    "diffusion_models": ("diffusion_models", "unet"),
    "text_encoders": ("text_encoders", "clip"),
    "vae": ("vae",),
    "loras": ("loras",),
}
DIFFUSERS_PREFIX = "diffusers/"
GGUF_FILES = "wanmesh_gguf"  # our own folder_paths entry: the diffusion-model folders, .gguf files only


def _folder_names(kind: str) -> list[str]:
    """The ComfyUI folder names of ``kind`` that exist here: a 2024 ComfyUI knows ``unet`` and gets
    ``diffusion_models`` only from an extra model paths file; today's maps ``unet`` onto ``diffusion_models``."""
    import folder_paths

    names = [name for name in FOLDER_ALIASES[kind] if name in folder_paths.folder_names_and_paths]
    if not names:
        raise KeyError(f"ComfyUI has no model folder for {kind!r} (looked for {', '.join(FOLDER_ALIASES[kind])})")
    return names


def _diffusers_folders() -> list[str]:
    import folder_paths

    found = []
    for root in folder_paths.folder_names_and_paths.get("diffusers", ([], None))[0]:
        if os.path.isdir(root):
            found += [DIFFUSERS_PREFIX + d for d in sorted(os.listdir(root)) if os.path.isdir(os.path.join(root, d))]
    return found


def list_models(kind: str) -> list[str]:
    """Files of a model folder plus diffusers folders (shown as 'diffusers/<name>')."""
    import folder_paths

    names = {name for folder in _folder_names(kind) for name in folder_paths.get_filename_list(folder)}
    if kind == "diffusion_models":
        names |= set(_gguf_files())
    return sorted(names) + _diffusers_folders()


def _gguf_files() -> list[str]:
    """GGUF transformers in the diffusion-model folders. ComfyUI lists only its own weight suffixes there, and
    adding .gguf to that entry would show them in native loaders that cannot read them, so a separate entry
    shares the same folder list (extra_model_paths included)."""
    import folder_paths

    folders = [folder for name in _folder_names("diffusion_models")
               for folder in folder_paths.folder_names_and_paths[name][0]]
    folder_paths.folder_names_and_paths[GGUF_FILES] = (list(dict.fromkeys(folders)), {".gguf"})
    return folder_paths.get_filename_list(GGUF_FILES)


def model_path(kind: str, name: str) -> str:
    """The full path of a listed model; a clear error when it is gone."""
    import folder_paths

    if name.startswith(DIFFUSERS_PREFIX):
        for root in folder_paths.folder_names_and_paths.get("diffusers", ([], None))[0]:
            candidate = os.path.join(root, name[len(DIFFUSERS_PREFIX):])
            if os.path.isdir(candidate):
                return candidate
    else:
        for folder in _folder_names(kind):
            path = folder_paths.get_full_path(folder, name)
            if path is not None:
                return path
    raise FileNotFoundError(
        f"model {name!r} was not found in ComfyUI's {kind!r} folders; refresh the node to list the files that exist"
    )


def list_vace_modules() -> list[str]:
    """Files of the diffusion-model folders that hold only VACE weights (read from each file's header)."""
    return [name for name in list_models("diffusion_models")
            if not name.startswith(DIFFUSERS_PREFIX) and _file_kind(model_path("diffusion_models", name)) == "vace_module"]


def _file_kind(path: str) -> str:
    """The file's kind from its header, read once per file version: ComfyUI asks a node for its inputs once per
    node of every prompt, and a graph with many model loaders would read every header that often."""
    stat = os.stat(path)
    return _kind_of_version(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4096)
def _kind_of_version(path: str, mtime_ns: int, size: int) -> str:
    from ...parallel import safetensors_kind

    return safetensors_kind(path)
