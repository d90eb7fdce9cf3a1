#!/usr/bin/env bash
# The GPU check: every `gpu` test, then rankwise vs torch timings, on a one-GPU machine.
#
#   bash benchmarks/gpu_check.sh            # from anywhere; about 3-5 minutes, at most 8
#   bash benchmarks/gpu_check.sh --dry-run  # no GPU: the gpu tests skip, the benchmark runs
#                                           # on the CPU (tiny model), results go to $TMPDIR
#
# Installs nothing: it uses the python, torch and rankwise source already on the machine
# (rankwise from this checkout's src/, via PYTHONPATH). Writes:
#   benchmarks/results/gpu-tests.txt   the pytest report of the gpu tests
#   benchmarks/results/gpu.json        the timings (benchmarks/gpu_bench.py), with the tests'
#                                      exit code in "gpu_tests_exit_code"
# Exit code: 0 when the tests and the benchmark both succeeded, else the first failure's.
# Time limits (timeout(1)): tests 270 s, benchmark 180 s, so the whole run stays under 8 min.
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
PY="${PYTHON:-python}"
DRY=()
RESULTS=benchmarks/results
if [ "${1:-}" = "--dry-run" ]; then
    DRY=(--dry-run)
    RESULTS="${TMPDIR:-/tmp}/rankwise-gpu-check"
elif [ $# -gt 0 ]; then
    echo "usage: $0 [--dry-run]" >&2
    exit 2
fi
mkdir -p "$RESULTS"
started=$(date +%s)

"$PY" - <<'PYEOF'
import torch, torch.distributed as dist
import rankwise
print(f"rankwise {rankwise.__file__}")
print(f"torch {torch.__version__} cuda {torch.version.cuda} available={torch.cuda.is_available()} "
      f"devices={torch.cuda.device_count()} nccl={dist.is_nccl_available()}")
if torch.cuda.is_available():
    print(f"device 0: {torch.cuda.get_device_name(0)}")
PYEOF
[ $? -eq 0 ] || exit 2
if [ ${#DRY[@]} -eq 0 ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "gpu_check: no CUDA device visible (use --dry-run to check the script on a CPU)" >&2
    exit 2
fi

# 1. Every test marked `gpu`, anywhere under tests/ (DDP, DataParallel, pipeline, parameter
#    server, checkpoints: tests/dist/test_gpu_paths.py and the CUDA tests beside the CPU ones).
#    Mixed precision and ZeRO: mark their CUDA tests `@pytest.mark.gpu` under tests/ and they
#    are selected here with the rest; nothing to add to this script.
timeout 270 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests -rs --timeout=240 \
    2>&1 | tee "$RESULTS/gpu-tests.txt"
tests_rc=${PIPESTATUS[0]}
echo "gpu tests: exit code $tests_rc ($(( $(date +%s) - started )) s so far)"

# -- place for further GPU checks (mixed precision, ZeRO benchmarks), each under its own
# -- `timeout`, keeping the total under 8 minutes --------------------------------------------

# 2. rankwise vs torch: DDP at world 1 (NCCL) and 2 (Gloo, one GPU), DataParallel on [0].
timeout 180 "$PY" benchmarks/gpu_bench.py "${DRY[@]}" --out "$RESULTS/gpu.json" \
    --tests-rc "$tests_rc" --timeout 150
bench_rc=$?
echo "gpu benchmark: exit code $bench_rc ($(( $(date +%s) - started )) s in all)"

if [ "$tests_rc" -ne 0 ]; then exit "$tests_rc"; fi
exit "$bench_rc"
