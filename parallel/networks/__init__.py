"""The networks, as single-device code that plans make parallel; runs in the workers (and the ComfyUI process
for the CLIP vision encoder).

Wan (the loaded diffusers transformer's native inputs), VACE with several contexts, causal Wan for streaming,
umT5 text encoding and its tensor-parallel plan, CLIP vision encoding, and the VAE's tiling, streaming decode and
pixel formats. Nothing here reads a weight file: ``parallel.weights`` builds these from files.
"""
