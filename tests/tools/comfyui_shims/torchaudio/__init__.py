"""Import-only stand-in for ``torchaudio``, for the recent ComfyUI test server (its process and the pack's workers).

PyPI has no torchaudio build for the CPU torch the tests use, yet ComfyUI 0.33
imports ``torchaudio`` at start-up (``comfy_extras/nodes_audio.py`` and
``nodes_audio_encoder.py`` via ``comfy/audio_encoders``; without it those node
modules fail to import) and calls it only inside audio nodes, which the tests
never run. This package lets those imports succeed; any use of it fails with an
error that says why.
``tests/tools/comfyui_server.py`` puts this folder's parent on ``PYTHONPATH``
for the recent server only, and only when no real torchaudio is installed.
It is never part of the pack.
"""


def __getattr__(name: str):
    raise AttributeError(f"torchaudio.{name} is unavailable: this torchaudio is an import-only test stand-in "
                         "(tests/tools/comfyui_shims); install a torchaudio matching torch to use audio nodes")
