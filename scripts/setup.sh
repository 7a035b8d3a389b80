#!/usr/bin/env bash
# Install acco_hooks and its dependencies into the current Python.
#
# The torch and torchtitan releases come from requirements/titan-<release>.txt, the stacks CI
# tests: torchtitan 0.2.2 with torch 2.13.0 by default; ACCO_TITAN=0.3.0 installs torchtitan
# 0.3.0 with torch 2.15.0 (a CUDA build of several GB that also runs on CPU). torch is installed
# first, when it is missing or outside what that release is tested with: installing anything
# that depends on torch before it would make pip pull the newest build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# pip's notes about this machine's package mirrors are noise; anything else is shown. pip runs
# quietly: each step says what it installs and, when done, how long it took.
pip_install() {
    local log start
    log=$(mktemp)
    start=$SECONDS
    if ! "$PYTHON" -m pip install -q "$@" >"$log" 2>&1; then
        cat "$log"
        echo "setup: pip install $* failed (see above)" >&2
        exit 1
    fi
    grep -v -e "^WARNING: Location" -e "^WARNING: Running pip as" "$log" || true
    rm -f "$log"
    echo "setup:   done in $((SECONDS - start)) s"
}

titan=${ACCO_TITAN:-0.2.2}
stack=requirements/titan-$titan.txt
if [ ! -f "$stack" ]; then
    echo "setup: ACCO_TITAN=$titan is not a supported torchtitan release (0.2.2 or 0.3.0)" >&2
    exit 1
fi
torch_pin=$(sed -n 's/^torch==//p' "$stack")
titan_pin=$(sed -n 's/^torchtitan==//p' "$stack")
# torch: installed when missing or another minor release than the one tested with torchtitan
if ! "$PYTHON" -c "
import sys, torch
have = torch.__version__.split('+')[0].split('.')[:2]
sys.exit(have != '$torch_pin'.split('.')[:2])" 2>/dev/null; then
    case $torch_pin in
        2.13.*) size="a CPU wheel of about 200 MB" ;;
        *) size="a CUDA build of about 6 GB with its CUDA libraries: several minutes" ;;
    esac
    echo "setup: installing torch==$torch_pin ($size)"
    pip_install "torch==$torch_pin"
fi
echo "setup: installing torchtitan==$titan_pin"
pip_install "torchtitan==$titan_pin"
echo "setup: installing acco_hooks[test] and its dependencies (transformers, datasets, torchft," \
    "matplotlib, ...: a few minutes on a fresh machine)"
pip_install -e ".[test]"
"$PYTHON" -c "import acco_hooks, torch; print(f'setup: acco_hooks {acco_hooks.__version__}, torch {torch.__version__}')"
