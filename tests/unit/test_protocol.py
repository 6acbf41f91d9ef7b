"""The request/reply protocol: plain data only, tensors as descriptors, a closed and versioned set of kinds."""

import pickle

import pytest
import torch

from wanmesh.parallel import protocol as P


class FakeTransport:
    """Keeps tensors aside and puts an index in the message, as a shared-memory descriptor would."""

    def __init__(self):
        self.store = []

    def pack(self, tensor):
        self.store.append(tensor.clone())
        return {"index": len(self.store) - 1}

    def unpack(self, descriptor):
        return self.store[descriptor["index"]]


def only_builtins(value):
    if isinstance(value, dict):
        return all(isinstance(k, str) and only_builtins(v) for k, v in value.items())
    if isinstance(value, list):
        return all(only_builtins(v) for v in value)
    return value is None or isinstance(value, (bool, int, float, str, bytes))


def sample_request():
    return P.SampleRequest(handle="model|x", latent=torch.randn(1, 16, 2, 4, 4), positive=[torch.randn(5, 8)],
                    negative=[torch.randn(5, 8)], seed=3, steps=4, guidance_scale=5.0, shift=3.0,
                           vace_frames=[torch.randn(1, 32, 2, 4, 4)], vace_masks=[torch.rand(1, 64, 2, 4, 4)],
                           vace_strengths=[0.5])


@pytest.mark.parametrize("message", [
    sample_request(), P.LoadModel("/m.safetensors", vace_module="/v.safetensors", dtype="bf16"), P.Health(),
    P.Unload(), P.EncodeText("text|t", ["a cat", "a dog"]), P.Images(torch.rand(5, 8, 8, 3)),
    P.Diagnostic("echo", {"n": 1}, [torch.ones(2)]), P.HealthReport([{"rank": 0, "pid": 1}]),
])
def test_round_trip_is_plain_data(message):
    transport = FakeTransport()
    wire = P.encode_message(message, transport.pack)
    assert only_builtins(wire) and wire["protocol"] == P.PROTOCOL_VERSION
    pickle.loads(pickle.dumps(wire))  # what the connection does
    again = P.decode_message(wire, transport.unpack)
    assert type(again) is type(message)
    for name in message.__dataclass_fields__:
        a, b = getattr(message, name), getattr(again, name)
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        elif isinstance(a, list) and a and isinstance(a[0], torch.Tensor):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        else:
            assert a == b


def test_every_request_has_a_reply_type():
    assert set(P.REPLY_TO) == set(P.REQUESTS.values())
    assert set(P.REPLY_TO.values()) <= set(P.REPLIES.values())


def test_unknown_version_kind_and_fields_are_refused():
    wire = P.encode_message(P.Health(), None)
    with pytest.raises(P.ProtocolError, match="protocol version 99 received, this side speaks version 1"):
        P.decode_message({**wire, "protocol": 99}, None)
    with pytest.raises(P.ProtocolError, match="unknown message kind 'train'"):
        P.decode_message({**wire, "kind": "train"}, None)
    with pytest.raises(P.ProtocolError, match=r"load_vae: unknown fields \['size'\]"):
        P.decode_message({**P.encode_message(P.LoadVae("/v"), None), "fields": {"path": "/v", "size": 3}}, None)


def test_objects_that_are_not_plain_data_cannot_cross():
    with pytest.raises(P.ProtocolError, match=r"diagnostic.args.fn: function cannot cross"):
        P.encode_message(P.Diagnostic("echo", {"fn": lambda: None}), None)


def test_tensors_in_finds_nested_tensors():
    assert len(P.tensors_in(sample_request())) == 5  # latent, two prompt embeddings, a VACE frame and mask


def test_worker_error_shows_rank_type_message_and_traceback():
    error = P.WorkerError(1, "ValueError", "bad shape", "Traceback (most recent call last):\n  ...")
    text = str(error)
    assert text.startswith("rank 1: ValueError: bad shape") and "Traceback" in text
    again = P.WorkerError.from_wire(error.to_wire())
    assert (again.rank, again.error_type, again.message, again.traceback) == (1, "ValueError", "bad shape", error.traceback)
