#!/usr/bin/env bash
# The CUDA path proven and measured in one command on one GPU (under 6 minutes on an H100 / H200):
#   bash tests/gpu/run.sh [--dry-run] [--out DIR] [--deadline SECONDS] [--only SECTION,...]
# Writes gpu_report.json and gpu_report.md to --out, else $OUT, else bench-out/gpu-check. `--dry-run` runs every
# section on the CPU at the smallest sizes (CI runs it; its numbers say nothing about a GPU). Without --dry-run and
# without a CUDA device it says so in one line and exits 2.
#
# The GPU machine has no network and lacks some of the pack's packages: `bash tests/gpu/fetch_wheels.sh` (run where
# pip can download) puts their wheels in .gpu-wheels/, which travels with the working tree; here every wheel whose
# package is missing, or older than the wheel, is installed into a temporary folder put on PYTHONPATH. The checkout
# itself is imported as the package `wanmesh` through a temporary folder holding a `wanmesh` link to it.
set -euo pipefail

caller="$(pwd)"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
PYTHON="${PYTHON:-python3}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1

dry_run=0
out="${OUT:-}"
args=()
while [ "$#" -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1; args+=("$1") ;;
        --out) [ "$#" -ge 2 ] || { echo "tests/gpu/run.sh: --out needs a folder" >&2; exit 2; }; out="$2"; shift ;;
        --out=*) out="${1#--out=}" ;;
        *) args+=("$1") ;;
    esac
    shift
done
out="${out:-bench-out/gpu-check}"
case "$out" in /*) ;; *) out="$caller/$out" ;; esac

cuda_check="import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"
if [ "$dry_run" = 0 ] && ! "$PYTHON" -c "$cuda_check" 2>/dev/null; then
    echo "tests/gpu/run.sh: no CUDA device is visible (or torch is missing); run it on a GPU, or pass --dry-run" >&2
    exit 2
fi

scratch="$(mktemp -d "${TMPDIR:-/tmp}/wanmesh-gpu-run.XXXXXX")"
trap 'rm -rf "$scratch"' EXIT
mkdir -p "$scratch/pkg" "$scratch/site"
ln -s "$root" "$scratch/pkg/wanmesh"
pythonpath="$scratch/pkg"

wheels="${WANMESH_GPU_WHEELS:-$root/.gpu-wheels}"
if [ "$dry_run" = 0 ] && [ -d "$wheels" ]; then
    # the wheels whose package is missing here or older than the wheel (the machine's own newer ones stay)
    mapfile -t needed < <("$PYTHON" - "$wheels" <<'PY'
import importlib.metadata as metadata, pathlib, re, sys

def key(version):
    return [int(re.match(r"\d*", part).group() or 0) for part in version.split(".")]

for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        installed = None
    if installed is None or key(installed) < key(version):
        print(wheel)
PY
)
    if [ "${#needed[@]}" -gt 0 ]; then
        names="$(for wheel in "${needed[@]}"; do basename "$wheel" | cut -d- -f1-2; done | tr '\n' ' ')"
        echo "== installing ${#needed[@]} wheels into $scratch/site: $names"
        if ! "$PYTHON" -m pip install -q --no-index --no-deps --target "$scratch/site" "${needed[@]}"; then
            echo "== pip failed; unpacking the wheels instead"
            for wheel in "${needed[@]}"; do "$PYTHON" -m zipfile -e "$wheel" "$scratch/site"; done
        fi
    fi
    pythonpath="$pythonpath:$scratch/site"
elif [ "$dry_run" = 0 ]; then
    echo "== no $wheels: using the packages installed here (tests/gpu/fetch_wheels.sh fetches them where pip can)"
fi
export PYTHONPATH="$pythonpath${PYTHONPATH:+:$PYTHONPATH}"

if ! "$PYTHON" -c "import diffusers, gguf, transformers, wanmesh.parallel.bench.gpu_check" 2>"$scratch/import.txt"; then
    echo "tests/gpu/run.sh: the packages the check needs do not import: $(tail -n 1 "$scratch/import.txt")" >&2
    exit 1
fi
status=0
"$PYTHON" -m wanmesh.parallel.cli bench gpu --out "$out" "${args[@]}" || status=$?
exit "$status"
