"""The prompt check of the WanMesh loaders (``nodes/bridge/prompt_checks.py``) on the shipped API workflows, with the tiny
models standing in for ComfyUI's model folders: it finds which model, VAE and text encoder each workflow uses
together, passes every shipped workflow, and refuses a Wan 2.2 VAE with a Wan 2.1 model (and the reverse) and a
text encoder of another width than the model's, in one line naming both files. The real server runs it in
``tests/comfyui/test_queue_refusals.py``."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from wanmesh.nodes.bridge import prompt_checks

WORKFLOWS_DIR = Path(__file__).resolve().parents[2] / "workflows"

MAX_MESSAGE = 300
API_WORKFLOWS = sorted(path.name for path in (WORKFLOWS_DIR / "api").glob("*.json"))


def load_workflow(relative_path: str) -> dict:
    return json.loads((WORKFLOWS_DIR / relative_path).read_text(encoding="utf-8"))


@pytest.fixture(autouse=True)
def tiny_folders(monkeypatch, tiny_models_root: Path):
    monkeypatch.setattr(prompt_checks, "model_path", lambda folder, name: str(tiny_models_root / folder / name))


def _with_file(prompt: dict, loader: str, name: str) -> dict:
    prompt = copy.deepcopy(prompt)
    for node in prompt.values():
        if node["class_type"] == loader:
            node["inputs"][prompt_checks.LOADERS[loader][0]] = name
    return prompt


def test_the_t2v_workflow_pairs_its_model_vae_and_text_encoder():
    found = {(Path(model).name, Path(vae[0]).name, Path(text[0]).name)
             for (model, _), vae, text in prompt_checks.model_partners(load_workflow("api/t2v.json"))}
    assert found == {("wan_tiny_t2v.safetensors", "wan_tiny_vae.safetensors", "umt5_tiny.safetensors")}


@pytest.mark.parametrize("workflow", API_WORKFLOWS)
def test_every_shipped_workflow_passes(workflow):
    prompt = load_workflow(f"api/{workflow}")
    assert list(prompt_checks.model_partners(prompt)), f"{workflow}: no model used with a VAE or text encoder found"
    prompt_checks.check_prompt_files(prompt)


REFUSED = [  # (workflow, loader, file swapped in, what the line says)
    ("t2v.json", "WanMeshVAELoader", "wan22_tiny_vae.safetensors",
     "vae_name wan22_tiny_vae.safetensors is the Wan 2.2 VAE (wan2.2_vae.safetensors), but model_name "
     "wan_tiny_t2v.safetensors works on 16-channel latents"),
    ("ti2v_5b.json", "WanMeshVAELoader", "wan_tiny_vae.safetensors",
     "vae_name wan_tiny_vae.safetensors is the Wan 2.1 VAE (wan_2.1_vae.safetensors), but model_name "
     "wan22_tiny_ti2v.safetensors works on 48-channel latents"),
    ("t2v.json", "WanMeshTextEncoderLoader", "umt5_native.safetensors",
     "text_encoder_name umt5_native.safetensors gives 4096-wide text embeddings, but model_name "
     "wan_tiny_t2v.safetensors reads 64-wide ones"),
]


@pytest.mark.parametrize("workflow, loader, name, message", REFUSED, ids=[f"{w}-{n}" for w, _, n, _ in REFUSED])
def test_files_that_do_not_fit_are_refused_naming_both(workflow, loader, name, message):
    with pytest.raises(ValueError) as refused:
        prompt_checks.check_prompt_files(_with_file(load_workflow(f"api/{workflow}"), loader, name))
    line = str(refused.value)
    assert message in line and "\n" not in line and len(line) <= MAX_MESSAGE, line


def test_no_prompt_no_check():
    prompt_checks.check_prompt_files(None)  # a loader called outside ComfyUI's executor


class NoRunner:
    def __getattr__(self, name):
        pytest.fail(f"the pool was asked to {name} latents of another latent space")


@pytest.mark.parametrize("vae, channels, message", [
    ("wan22_tiny_vae.safetensors", 16, "samples are 16-channel latents, but vae wan22_tiny_vae.safetensors is the Wan "
                                       "2.2 VAE (wan2.2_vae.safetensors): decode them with the Wan 2.1 VAE"),
    ("wan_tiny_vae.safetensors", 48, "samples are 48-channel latents, but vae wan_tiny_vae.safetensors is the Wan 2.1 "
                                     "VAE (wan_2.1_vae.safetensors): decode them with the Wan 2.2 VAE"),
])
def test_the_decode_node_refuses_latents_of_another_vae(tiny_models_root, vae, channels, message):
    """Latents reaching the decode from anywhere (a native sampler too): their channels against the VAE's header."""
    import torch

    from wanmesh.nodes.bridge.runtime import ResidentModel
    from wanmesh.nodes.vae import WanMeshVAEDecode

    loaded = ResidentModel(NoRunner(), "vae|x", path=str(tiny_models_root / "vae" / vae), kind="vae")
    with pytest.raises(ValueError) as refused:
        WanMeshVAEDecode().decode(loaded, {"samples": torch.zeros(1, channels, 2, 4, 4)})
    line = str(refused.value)
    assert message in line and "\n" not in line and len(line) <= MAX_MESSAGE, line
