"""``ModelForward``: what a sampler in the driver's process sends per model call, checked before it is sent, and
one rank's call equal to the worker loop's own model call (the same prediction function, VACE inputs alike)."""

from __future__ import annotations

import pytest
import torch

from wanmesh.parallel.protocol import ModelForward, decode_message, encode_message
from wanmesh.parallel.sampling.forward import forward_rows, vace_call_inputs

LATENT = torch.zeros(2, 16, 2, 4, 4)


def request(**changes) -> ModelForward:
    fields = dict(handle="model|x||fp32|keep", latent=LATENT, timestep=torch.full((2,), 900.0),
                  context=torch.zeros(2, 7, 64))
    return ModelForward(**{**fields, **changes})


@pytest.mark.parametrize("changes, message", [
    (dict(timestep=torch.zeros(3)), "one timestep per row"),
    (dict(context=torch.zeros(1, 7, 64)), r"text context of shape \[1, 7, 64\]"),
    (dict(vace_context=torch.zeros(2, 1, 96, 2, 4, 4), vace_strengths=[1.0, 1.0]), "VACE context has shape"),
    (dict(vace_context=torch.zeros(2, 1, 96, 2, 4, 4), vace_strengths=[float("nan")]), "finite"),
    (dict(loras=[("a.safetensors", 500.0)]), "LoRA strength"),
    (dict(latent=torch.zeros(2, 15, 2, 4, 4)), "model input must be"),
])
def test_bad_model_calls_are_refused_in_one_line(changes, message) -> None:
    with pytest.raises(ValueError, match=message) as caught:
        request(**changes).validate()
    assert "\n" not in str(caught.value)


def test_a_model_call_crosses_the_process_boundary_unchanged() -> None:
    sent = request(vace_context=torch.randn(2, 2, 96, 2, 4, 4), vace_strengths=[1.0, 0.5], loras=[("l.st", 0.8)])
    sent.validate()
    tensors: list[torch.Tensor] = []
    received = decode_message(encode_message(sent, lambda t: tensors.append(t) or len(tensors) - 1),
                              lambda index: tensors[index])
    assert isinstance(received, ModelForward) and received.vace_strengths == [1.0, 0.5]
    assert torch.equal(received.vace_context, sent.vace_context) and received.loras == [["l.st", 0.8]]


class RecordingModel(torch.nn.Module):
    """Records the keyword arguments of its call; predicts latents times the first timestep."""

    def __init__(self, vace_layers=None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))
        self.config = type("Config", (), {"vace_layers": vace_layers})()
        self.calls: list[dict] = []

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict, **extra):
        self.calls.append({"timestep": timestep, "context": encoder_hidden_states, **extra})
        return (hidden_states * timestep.view(-1, 1, 1, 1, 1),)


def test_forward_rows_runs_only_its_rows_with_their_timesteps() -> None:
    model = RecordingModel()
    latent = torch.randn(3, 16, 1, 2, 2)
    sent = request(latent=latent, timestep=torch.tensor([1.0, 2.0, 3.0]), context=torch.randn(3, 5, 64))
    out = forward_rows(model, sent, range(1, 3), torch.float32, "cpu")
    assert torch.equal(out, latent[1:3] * torch.tensor([2.0, 3.0]).view(-1, 1, 1, 1, 1))
    assert torch.equal(model.calls[0]["context"], sent.context[1:3])


def test_vace_model_without_vace_context_gets_the_default_and_one_context_its_single_form() -> None:
    model = RecordingModel(vace_layers=[0, 2])
    forward_rows(model, request(), range(2), torch.float32, "cpu")
    default = model.calls[0]
    assert default["control_hidden_states"].shape == (2, 96, 2, 4, 4)
    assert torch.equal(default["control_hidden_states_scale"], torch.ones(2))
    several = vace_call_inputs(torch.randn(2, 2, 96, 2, 4, 4), [1.0, 0.5], 2, torch.float32, "cpu")
    assert several["control_hidden_states"].shape == (2, 2, 96, 2, 4, 4)
    assert several["control_hidden_states_scale"].tolist() == [1.0, 0.5]
    with pytest.raises(ValueError, match="no VACE blocks"):
        forward_rows(RecordingModel(), request(vace_context=torch.zeros(2, 1, 96, 2, 4, 4), vace_strengths=[1.0]),
                     range(2), torch.float32, "cpu")
