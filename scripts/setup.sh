#!/usr/bin/env bash
# Install acco_hooks and its dependencies into the current Python.
#
# torch is installed first, pinned to 2.13.0, when it is missing: installing anything that
# depends on torch before it would make pip pull the newest (multi-GB CUDA) build. Then the
# torchtitan release: 0.2.2 by default; ACCO_TITAN=0.3.0 installs torchtitan 0.3.0 with the
# torch it is tested on (2.14.1; a CUDA build of about 6 GB that also runs on CPU).
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

titan=${ACCO_TITAN:-0.2.2}
case "$titan" in
    0.2.2) torch_pin="2.13.0"; torch_floor="2.13" ;;
    0.3.0) torch_pin="2.14.1"; torch_floor="2.14" ;;
    *) echo "setup: ACCO_TITAN=$titan is not a supported torchtitan release (0.2.2 or 0.3.0)" >&2
       exit 1 ;;
esac
# torch: installed when missing or older than the release needs
if ! "$PYTHON" -c "
import sys, torch
have = tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2])
sys.exit(have < tuple(int(p) for p in '$torch_floor'.split('.')))" 2>/dev/null; then
    echo "setup: installing torch==$torch_pin"
    pip_install "torch==$torch_pin"
fi
echo "setup: installing torchtitan==$titan"
pip_install "torchtitan==$titan"
echo "setup: installing acco_hooks[test] and its dependencies"
pip_install -e ".[test]"
"$PYTHON" -c "import acco_hooks, torch; print(f'setup: acco_hooks {acco_hooks.__version__}, torch {torch.__version__}')"
