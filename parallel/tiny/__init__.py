"""Tiny test models: random Wan / VACE / VAE / umT5 / LoRA / GGUF files in the formats users have, small enough
for CPU tests and the README's main job; runs in the CLI process (`wanmesh make-tiny`), benchmarks and tests.

Only ``files`` is light (paths, no model libraries); the writers import diffusers and transformers.
"""
