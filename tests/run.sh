#!/usr/bin/env bash
# Set up everything on a fresh machine and run the whole test suite (unit, distributed, real ComfyUI).
# Installs CPU torch (pinned), the pack with its test extras, Debian's Chromium for the browser tests (as root),
# and the ComfyUI copies under build/; then pytest.
# Extra arguments go to pytest, e.g. `tests/run.sh tests/unit -k sampler`.
# WANMESH_SKIP_INSTALL=1 skips the install steps when they are already done.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
export HF_HUB_OFFLINE=1
export PIP_DISABLE_PIP_VERSION_CHECK=1
PYTHON="${PYTHON:-python3}"

if [ "${WANMESH_SKIP_INSTALL:-0}" != "1" ]; then
    echo "== install torch (CPU) and pin it"
    # Torch first, then pinned: otherwise a dependency may pull a multi-GB CUDA build instead.
    "$PYTHON" -m pip install "torch==2.13.0"
    constraints="$(mktemp)"
    trap 'rm -f "$constraints"' EXIT
    echo "torch==2.13.0" >"$constraints"

    echo "== install the pack with its test dependencies"
    "$PYTHON" -m pip install -c "$constraints" -e ".[test]"
    if "$PYTHON" -c "import torchvision" 2>/dev/null; then
        echo "torchvision is installed; it does not match this torch build and breaks diffusers imports:" >&2
        echo "run '$PYTHON -m pip uninstall -y torchvision'" >&2
        exit 1
    fi

    # The browser tests drive the system Chromium (playwright never downloads one here).
    if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then
        echo "== chromium: $(command -v chromium || command -v chromium-browser)"
    elif [ "$(id -u)" -eq 0 ]; then
        echo "== install chromium (Debian package) for the browser tests"
        apt_log="$(mktemp)"
        if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >"$apt_log" 2>&1; then
            tail -n 40 "$apt_log" >&2
            echo "installing chromium failed (see above)" >&2
            exit 1
        fi
        rm -f "$apt_log"
    else
        echo "== chromium is missing and this is not root: skipping its install ('apt-get install -y chromium' as root)" >&2
    fi

    echo "== prepare the ComfyUI copies"
    "$PYTHON" tests/tools/prepare_comfyui.py
fi
install_seconds=$SECONDS

echo "== run the tests"
# -ra lists every skip and failure in the final summary; a hung test fails after the timeout.
# --confcutdir keeps pytest from importing the repository root (the pack's __init__.py) as a test
# package, which fails when the checkout folder name is not a Python identifier.
pytest_run() { "$PYTHON" -m pytest -ra --timeout=600 --durations=40 --confcutdir=tests "$@"; }

if [ "$#" -gt 0 ]; then
    pytest_run "$@"
    exit
fi
# Each half runs in two pytest processes side by side, each test file whole in one of them (pytest-xdist
# --dist loadfile: a file's module-scoped servers and pools stay in one process). On a 2-core machine the unit
# and distributed half gains little (about 15.5 min against 16 serially: torch already uses both cores); the
# ComfyUI, browser and fault half, which waits on server and worker starts (single-threaded imports), took
# 21 min against 26 serially. The halves run one after the other so that the second's servers and browsers
# do not share the cores with the first's compute-bound ranks.
status=0
time_row() { printf '%-28s %3d:%02d\n' "$1" $(($2 / 60)) $(($2 % 60)); }  # name, seconds
times="$(time_row install "$install_seconds")"$'\n'
run_suite() {  # name, test folders...; keeps going after a failure, and notes the suite's minutes
    local name="$1" started=$SECONDS seconds
    shift
    pytest_run -n 2 --dist loadfile --no-loadscope-reorder "$@" || status=$?
    seconds=$((SECONDS - started))
    times+="$(time_row "$name" "$seconds")"$'\n'
}
run_suite "unit and distributed" tests/unit tests/distributed
run_suite "ComfyUI, browser and faults" tests/comfyui tests/faults
times+="$(time_row total "$SECONDS")"$'\n'
echo "== time per suite (min:s)"
printf '%s' "$times"
exit "$status"
