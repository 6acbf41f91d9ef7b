"""The streamed Wan VAE decode (chunk after chunk, causal cache kept) gives the frames of one whole decode."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKLWan

from wanmesh.parallel.networks.frames import pixels_to_frames
from wanmesh.parallel.tiny.models import TINY_VAE, randomise_
from wanmesh.parallel.networks.vae_stream import StreamingVaeDecoder, stream_decoded_frame_count


@pytest.fixture(scope="module")
def vae():
    torch.manual_seed(0)
    model = AutoencoderKLWan(**TINY_VAE).eval()
    randomise_(model, 5)
    return model


@pytest.fixture(scope="module")
def latents():
    return torch.randn(1, 16, 8, 4, 6, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def whole(vae, latents):
    with torch.no_grad():
        return vae.decode(latents, return_dict=False)[0]  # diffusers' own decode: the reference


@pytest.mark.parametrize("sizes", [[3, 3, 2], [1] * 8, [8]])
def test_streamed_chunks_join_to_the_whole_decode(vae, latents, whole, sizes):
    decoder = StreamingVaeDecoder(vae)
    pieces, start = [], 0
    for size in sizes:
        piece = decoder.decode_pixels(latents[:, :, start: start + size])
        assert piece.shape[2] == stream_decoded_frame_count(start, size)
        pieces.append(piece)
        start += size
    joined = torch.cat(pieces, dim=2)
    assert joined.shape == whole.shape == (1, 3, 4 * 8 - 3, 32, 48)
    torch.testing.assert_close(joined.clamp(-1, 1), whole, rtol=1e-5, atol=1e-5)  # raw chunks; diffusers clamps
    if len(sizes) > 1:  # the carried cache matters: chunk 1 after another chunk 0 comes out different
        cold = StreamingVaeDecoder(vae)
        cold.decode_pixels(torch.zeros_like(latents[:, :, : sizes[0]]))
        second = cold.decode_pixels(latents[:, :, sizes[0]: sizes[0] + sizes[1]])
        assert second.shape == pieces[1].shape
        assert not torch.allclose(second, pieces[1], atol=1e-3)

def test_frames_and_reset(vae, latents, whole):
    decoder = StreamingVaeDecoder(vae)
    decoder.decode_frames(latents[:, :, :2])
    decoder.reset()
    frames = torch.cat([decoder.decode_frames(latents[:, :, :5]), decoder.decode_frames(latents[:, :, 5:])])
    torch.testing.assert_close(frames, pixels_to_frames(whole), rtol=1e-5, atol=1e-5)


def test_bad_chunk_is_refused(vae):
    with pytest.raises(ValueError, match="latent chunk"):
        StreamingVaeDecoder(vae).decode_pixels(torch.zeros(1, 4, 2, 4, 4))
