#!/usr/bin/env bash
# The GPU checks of docs/cuda.md in one call, for a lent GPU machine with a time limit:
#
#     bash scripts/gpu_check.sh OUT [WHEELS] [BENCH_ARGS...]
#
# 1. `pytest -m cuda tests/test_cuda.py` and the same tests under TORCH_CUDA_SANITIZER=1 (not
#    the torchtitan ones: the sanitizer cannot follow compiled code), side by side;
# 2. then, alone on the GPU, benchmarks/cuda_overhead.py with BENCH_ARGS;
# 3. with FAKE_RANK=1, then benchmarks/fake_rank.py: one rank of each 8B config at its real shape.
# Logs, JUnit files, the benchmarks' result files and their runs' logs (bench_runs.tgz,
# fake_rank_runs.tgz) go to OUT. CUDA_TESTS=EXPR runs only the tests pytest's -k EXPR selects;
# SANITIZER=0 skips the sanitized suite, SUITE=0 both suites; BENCH=0 skips the overhead
# benchmark (a second call after a fix). WHEELS (default .whl), where it
# exists, holds wheels of what the machine's Python lacks (torchtitan and its dependencies, as
# docs/cuda.md lists): they are installed under /tmp/acco_site, never into the machine's own
# site-packages. Every phase has a time limit (SUITE_S, BENCH_S, FAKE_S seconds) so that the logs of a
# phase cut short still come back.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: bash scripts/gpu_check.sh OUT [WHEELS] [BENCH_ARGS...]}
wheels=${2:-.whl}
shift $(( $# >= 2 ? 2 : 1 ))
mkdir -p "$out"
# A GPU image's own torch is usually outside the tested range (2.11 is below it).
export ACCO_HOOKS_UNTESTED_VERSIONS=1 PYTHONUNBUFFERED=1
PYTHON=${PYTHON:-python3}

if [ -d "$wheels" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/acco_site "$wheels"/*.whl || exit 1
    export PYTHONPATH=/tmp/acco_site:$PWD
    # datasets needs a newer pyarrow than some images have: fall back to an older datasets
    if ! "$PYTHON" -c "import datasets" 2>/dev/null && [ -d "$wheels/fallback" ]; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/acco_site "$wheels"/fallback/*.whl || exit 1
    fi
fi

{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    "$PYTHON" - <<'PY'
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "nccl", torch.cuda.nccl.version(), "device", torch.cuda.get_device_name())
for name in ("torchtitan", "datasets", "pyarrow", "transformers", "triton", "xdist"):
    try:
        module = __import__(name)
        print(name, getattr(module, "__version__", "?"))
    except Exception as error:  # what is missing is what this file is for
        print(name, "NOT IMPORTABLE:", repr(error))
PY
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

select=()
[ -n "${CUDA_TESTS:-}" ] && select=(-k "$CUDA_TESTS")
parallel=()
"$PYTHON" -c "import xdist" 2>/dev/null && parallel=(-n "${WORKERS:-6}")
suite_s=${SUITE_S:-170}
if [ "${SUITE:-1}" = 1 ]; then
    timeout "$suite_s" "$PYTHON" -m pytest -m cuda tests/test_cuda.py "${select[@]}" -v -rs \
        "${parallel[@]}" -p no:cacheprovider --durations=15 --junitxml="$out/cuda.xml" \
        >"$out/cuda.log" 2>&1 &
    suite=$!
    if [ "${SANITIZER:-1}" = 1 ]; then
        TORCH_CUDA_SANITIZER=1 timeout "$suite_s" "$PYTHON" -m pytest -m cuda tests/test_cuda.py \
            -k "not titan${CUDA_TESTS:+ and ($CUDA_TESTS)}" -v -rs "${parallel[@]}" \
            -p no:cacheprovider --durations=15 --junitxml="$out/sanitizer.xml" \
            >"$out/sanitizer.log" 2>&1 &
        sanitized=$!
    fi
    wait $suite; echo "cuda suite: rc $?"; tail -n 25 "$out/cuda.log"
    if [ "${SANITIZER:-1}" = 1 ]; then
        wait $sanitized; echo "sanitizer suite: rc $?"; tail -n 25 "$out/sanitizer.log"
        grep -m 20 -n "CSAN" "$out/sanitizer.log" "$out/cuda.log"
    fi
fi

if [ "${BENCH:-1}" = 1 ]; then
    timeout "${BENCH_S:-260}" "$PYTHON" -m benchmarks.cuda_overhead "$@" >"$out/bench.log" 2>&1
    echo "benchmark: rc $?"; tail -n 20 "$out/bench.log"
    cp outputs/results/cuda_overhead.json "$out/" 2>/dev/null || true
    tar czf "$out/bench_runs.tgz" outputs/cuda_overhead/*.log 2>/dev/null || true
fi

if [ "${FAKE_RANK:-0}" = 1 ]; then
    timeout "${FAKE_S:-420}" "$PYTHON" -m benchmarks.fake_rank >"$out/fake_rank.log" 2>&1
    echo "fake rank: rc $?"; tail -n 12 "$out/fake_rank.log"
    cp outputs/results/fake_rank_8b.json "$out/" 2>/dev/null || true
    tar czf "$out/fake_rank_runs.tgz" outputs/fake_rank/*.log 2>/dev/null || true
fi
