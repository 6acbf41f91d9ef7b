#!/usr/bin/env bash
# Download, on a machine with network, the wheels the GPU check needs but the GPU machine lacks (it has Python 3.12,
# torch with CUDA, Triton, transformers, safetensors, accelerate, numpy and OpenCV, and no network): diffusers, gguf,
# ftfy, SentencePiece, Pillow (diffusers imports it), pytest and the small packages they import, as CPython 3.12
# manylinux x86_64 or pure wheels.
# They go to .gpu-wheels/ (ignored by git), which travels with the working tree; `tests/gpu/run.sh` installs from it.
# PyAV (about 36 MiB) is left out to keep the tree small: the GPU check does not write MP4 files.
# Usage: bash tests/gpu/fetch_wheels.sh [FOLDER]
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
folder="${1:-.gpu-wheels}"
mkdir -p "$folder"

# The versions the test suite runs with; huggingface-hub is the oldest that this diffusers accepts (run.sh only
# installs it where the machine's own is older).
WHEELS=(
    diffusers==0.42.1 huggingface-hub==1.32.0 importlib_metadata==10.2.0 zipp==4.1.2 safetensors==0.8.0
    pillow==13.0.0 gguf==0.19.0 ftfy==6.3.1 wcwidth==0.7.0 sentencepiece==0.2.3
    pytest==9.0.3 pluggy==1.6.0 iniconfig==2.3.0 pygments==2.20.0
)

python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$folder" "${WHEELS[@]}"
du -sh "$folder"
