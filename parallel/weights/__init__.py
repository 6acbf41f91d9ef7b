"""Model weight files and their formats; runs in the workers (and the driver, for header-only checks).

Reading safetensors (and weights-only pickles), scaled fp8 and GGUF files as name maps with per-tensor readers,
dequantization (kept quantized layers), each rank's sharded reads, recognising a file's model kind and config
from its tensor shapes, LoRA files, and the loaders that read a file into a network of ``parallel.networks``.
Imports go one way: this package uses ``parallel.networks``; nothing there reads a file.
"""
