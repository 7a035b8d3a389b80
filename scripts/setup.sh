#!/usr/bin/env bash
# Install acco_hooks and its dependencies into the current Python.
#
# torch is installed first, pinned to 2.13.0, when it is missing: installing anything that
# depends on torch before it would make pip pull the newest (multi-GB CUDA) build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# pip's notes about this machine's package mirrors are noise; anything else is shown.
pip_install() {
    local log
    log=$(mktemp)
    if ! "$PYTHON" -m pip install -q "$@" >"$log" 2>&1; then
        cat "$log"
        echo "setup: pip install $* failed (see above)" >&2
        exit 1
    fi
    grep -v -e "^WARNING: Location" -e "^WARNING: Running pip as" "$log" || true
    rm -f "$log"
}

if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==2.13.0"
    pip_install "torch==2.13.0"
fi
echo "setup: installing acco_hooks[test] and its dependencies"
pip_install -e ".[test]"
"$PYTHON" -c "import acco_hooks, torch; print(f'setup: acco_hooks {acco_hooks.__version__}, torch {torch.__version__}')"
