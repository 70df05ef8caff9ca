#!/usr/bin/env bash
# One command for a GPU machine (issues 27, 52): where the fp16 GN+PN input gradient leaves float64
# (scripts/gpu_grad_diag.py), the CUDA and kernel tests, compute-sanitizer memcheck on one training step of each
# Triton-backed layer and racecheck on one, benchmarks/gpu.py at P2/P3 in bf16 and fp32 (host and device time
# apart), and a whole detector's training step (benchmarks/detector_step.py), in under 8 minutes on one H100/H200.
#
#   scripts/gpu_check.sh RESULTS_DIR          # PYTHON=... to choose the interpreter (default python3)
#   GPU_CHECK_SECONDS=300 scripts/gpu_check.sh RESULTS_DIR    # a shorter budget (default 440 s)
#   GPU_CHECK_STEPS=diag,pytest scripts/gpu_check.sh RESULTS_DIR   # some steps only (diag, pytest, memcheck,
#                                                                  # benchmark, detector; default all)
#
# Needs only torch and triton (and pytest; torchvision for the detector) from the machine: nothing is installed
# or downloaded, mmcv is not needed (NORMDENSE_LAYERS_ONLY=1 where mmengine or mmcv is missing; mmengine's tests
# are then reported as skipped); pytest-xdist, where there, runs the tests in 12 processes. Writes into
# RESULTS_DIR: grad_diag.log/.json/.pt, pytest.log, sanitizer.log, racecheck.log, benchmark.log/.json/.md,
# detector.log/.json/.md, summary.md and summary.json (each step's outcome, the machine).
# Without a GPU it says so in one line and exits 1; without triton, compute-sanitizer, pytest or torchvision it
# skips the steps that need them, one line each. Exit status 1 when a step failed.
set -u

usage="usage: scripts/gpu_check.sh RESULTS_DIR"
case "${1:-}" in
    -h|--help) echo "$usage"; echo "Runs the GPU checks of normdense (docs/gpu.md) and writes their results into RESULTS_DIR."; exit 0 ;;
esac
if [ "$#" -ne 1 ] || [ -z "$1" ]; then
    echo "gpu_check: $usage (got $# arguments)" >&2; exit 2
fi
out=$1
if [ -e "$out" ] && [ ! -d "$out" ]; then
    echo "gpu_check: RESULTS_DIR '$out' exists and is not a directory" >&2; exit 2
fi
mkdir -p "$out" || { echo "gpu_check: cannot create RESULTS_DIR '$out'" >&2; exit 2; }
out=$(cd "$out" && pwd)

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # the kernels must compile for the GPU, not run in Triton's interpreter
start=$SECONDS
deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-440}))  # under 8 minutes with the summary (a lease may want less)
wanted=",${GPU_CHECK_STEPS:-diag,pytest,memcheck,benchmark,detector},"
wants() { [[ $wanted == *",$1,"* ]]; }
steps=$(mktemp)
trap 'rm -f "$steps"' EXIT

fail_early() {  # one line: what is missing; also the summary, for whoever collects RESULTS_DIR
    echo "gpu_check: $1" >&2
    printf '# gpu_check\n\nNot run: %s\n' "$1" >"$out/summary.md"
    exit 1
}

command -v "$PYTHON" >/dev/null 2>&1 || fail_early "missing: $PYTHON (set PYTHON to the interpreter that has torch)"
probe=$("$PYTHON" - 2>/dev/null <<'EOF' | tail -n 1
import importlib.util, sys
try:
    import torch
except Exception as e:
    print(f'notorch {type(e).__name__}: {e}'.replace('\n', ' '))
    sys.exit()
gpu = torch.cuda.is_available()
try:
    import triton
    tv = triton.__version__
except Exception:
    tv = '-'
mm = 'yes' if all(importlib.util.find_spec(m) for m in ('mmengine', 'mmcv')) else 'no'
tvis = 'yes' if importlib.util.find_spec('torchvision') else 'no'
pt = ('xdist' if importlib.util.find_spec('xdist') else 'yes') if importlib.util.find_spec('pytest') else 'no'
name = torch.cuda.get_device_name().replace(' ', '_') if gpu else '-'
print('ok', torch.__version__, torch.version.cuda or '-', int(gpu), name, tv, mm, pt,
      sys.version.split()[0], tvis)
EOF
)
set -- $probe
[ "${1:-}" = ok ] || fail_early "missing: torch in $PYTHON (${probe#notorch }): nothing run"
torch_v=$2 cuda_v=$3 has_gpu=$4 device=${5//_/ } triton_v=$6 has_mm=$7 has_pytest=$8 py_v=$9 has_tv=${10}
[ "$has_gpu" = 1 ] || fail_early "missing: a CUDA GPU (torch $torch_v, CUDA build $cuda_v, sees none): nothing run"
[ "$has_mm" = yes ] || export NORMDENSE_LAYERS_ONLY=1

sanitizer=$(command -v compute-sanitizer || true)
[ -n "$sanitizer" ] || [ ! -x "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer" ] \
    || sanitizer="${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer"

record() {  # step, status, seconds, detail
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >>"$steps"
    echo "gpu_check: $1: $2 ($3 s) $4"
}
budget() {  # seconds left for a step: at most $1, at least 30
    local left=$((deadline - SECONDS))
    [ "$left" -lt "$1" ] && echo $((left > 30 ? left : 30)) || echo "$1"
}

# 0. where the fp16 GN+PN input gradient leaves float64 (issue 52): first, so that its data come back whatever else
if ! wants diag; then :
elif [ "$triton_v" = - ]; then
    echo "gpu_check: missing: triton: the gradient diagnosis not run" >&2
    record diag SKIPPED 0 "missing: triton"
else
    t0=$SECONDS
    timeout -k 10 "$(budget 80)" "$PYTHON" scripts/gpu_grad_diag.py "$out" >"$out/grad_diag.log" 2>&1
    rc=$?
    line=$(grep -E '^gpu_grad_diag: ' "$out/grad_diag.log" | tail -n 1)
    [ "$rc" = 0 ] && status=PASS || status=FAIL
    [ "$rc" = 124 ] && line="stopped at its time limit; $(grep -c '^ok ' "$out/grad_diag.log") cases ok"
    record diag "$status" $((SECONDS - t0)) "${line:-see grad_diag.log}"
fi

# 1. tests/cuda and tests/kernels on CUDA
if ! wants pytest; then :
elif [ "$has_pytest" = no ]; then
    echo "gpu_check: missing: pytest: the CUDA and kernel tests not run" >&2
    record pytest SKIPPED 0 "missing: pytest"
else
    paths=(tests/cuda tests/kernels)
    # the sm_90 report compiles on the CPU and rewrites a committed file: CI's job, not the GPU's
    deselect=(--deselect tests/kernels/test_sm90_report.py)
    workers=()  # Triton compiles on the CPU: spread the kernel variants over processes sharing the GPU
    [ "$has_pytest" = xdist ] && workers=(-n 12)
    if [ "$triton_v" = - ]; then
        echo "gpu_check: missing: triton: tests/kernels and the Triton-vs-ATen CUDA test not run" >&2
        paths=(tests/cuda)
        deselect+=(--deselect tests/cuda/test_triton_cuda.py::test_triton_matches_aten_on_cuda)
    fi
    t0=$SECONDS
    timeout -s INT -k 20 "$(budget 150)" "$PYTHON" -m pytest "${paths[@]}" "${deselect[@]}" "${workers[@]}" -q -ra \
        -p no:cacheprovider >"$out/pytest.log" 2>&1
    rc=$?
    line=$(grep -E '(passed|failed|error|skipped|no tests ran)' "$out/pytest.log" | tail -n 1 | tr -d '=' | xargs)
    [ "$rc" = 0 ] && status=PASS || status=FAIL
    [ "$rc" = 124 ] || [ "$rc" = 130 ] && line="stopped at its time limit; $line"
    record pytest "$status" $((SECONDS - t0)) "${line:-see pytest.log}"
fi

# 2. compute-sanitizer memcheck on one training step of each Triton-backed layer
if ! wants memcheck; then :
elif [ "$triton_v" = - ]; then
    echo "gpu_check: missing: triton: the memcheck step not run" >&2
    record memcheck SKIPPED 0 "missing: triton"
elif [ -z "$sanitizer" ]; then
    echo "gpu_check: missing: compute-sanitizer (not on PATH nor in \$CUDA_HOME/bin): the memcheck step not run" >&2
    record memcheck SKIPPED 0 "missing: compute-sanitizer"
else
    t0=$SECONDS
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout -k 20 "$(budget 40)" "$sanitizer" --tool memcheck \
        --error-exitcode 1 --print-limit 50 "$PYTHON" scripts/gpu_step.py >"$out/sanitizer.log" 2>&1
    rc=$?
    line=$(grep -E 'ERROR SUMMARY' "$out/sanitizer.log" | tail -n 1 | sed 's/^=* *//')
    [ "$rc" = 0 ] && status=PASS || status=FAIL
    [ "$rc" = 124 ] && line="stopped at its time limit; $line"
    why=$(grep -E '^gpu_step.py: ' "$out/sanitizer.log" | tail -n 1)  # the program's own failure, if any
    record memcheck "$status" $((SECONDS - t0)) \
        "${line:-see sanitizer.log} ($(grep -c '^ok ' "$out/sanitizer.log") steps ok)${why:+; $why}"
    t0=$SECONDS  # racecheck (shared-memory hazards) is slow: one step
    timeout -k 20 "$(budget 25)" "$sanitizer" --tool racecheck --error-exitcode 1 --print-limit 50 \
        "$PYTHON" scripts/gpu_step.py --one >"$out/racecheck.log" 2>&1
    rc=$?
    line=$(grep -E 'RACECHECK SUMMARY|ERROR SUMMARY' "$out/racecheck.log" | tail -n 1 | sed 's/^=* *//')
    [ "$rc" = 0 ] && status=PASS || status=FAIL
    [ "$rc" = 124 ] && line="stopped at its time limit; $line"
    record racecheck "$status" $((SECONDS - t0)) \
        "${line:-see racecheck.log} ($(grep -c '^ok ' "$out/racecheck.log") steps ok)"
fi

# 3. the benchmark (its targets are reported, not failed on); kernels compiled by the tests are in the cache
if wants benchmark; then
    t0=$SECONDS
    timeout -k 20 "$(budget 70)" "$PYTHON" benchmarks/gpu.py --levels P2,P3 --dtypes bf16,fp32 --repeats 8 --warmup 2 \
        --out "$out/benchmark.json" --md "$out/benchmark.md" \
        >"$out/benchmark.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] && status=PASS || status=FAIL
    line="targets: $(grep -c '^PASS ' "$out/benchmark.log") PASS, $(grep -c '^FAIL ' "$out/benchmark.log") FAIL"
    [ "$rc" = 124 ] && line="stopped at its time limit"
    [ "$triton_v" = - ] && line="$line (no triton: its Triton rows n/a)"
    record benchmark "$status" $((SECONDS - t0)) "$line"
fi

# 4. a whole detector's training step (torchvision's Mask R-CNN v2, converted norms), bf16 autocast
if ! wants detector; then :
elif [ "$has_tv" != yes ]; then
    echo "gpu_check: missing: torchvision: the detector step not run" >&2
    record detector SKIPPED 0 "missing: torchvision"
else
    t0=$SECONDS
    timeout -k 10 "$(budget 70)" "$PYTHON" benchmarks/detector_step.py --steps 20 --warmup 2 \
        --out "$out/detector.json" --md "$out/detector.md" >"$out/detector.log" 2>&1
    rc=$?
    [ "$rc" = 0 ] && status=PASS || status=FAIL
    line="targets: $(grep -c '^PASS ' "$out/detector.log") PASS, $(grep -c '^FAIL ' "$out/detector.log") FAIL"
    [ "$rc" = 124 ] && line="stopped at its time limit"
    [ "$rc" != 0 ] && [ "$rc" != 124 ] && line="$(grep -E 'Error|error' "$out/detector.log" | tail -n 1)"
    record detector "$status" $((SECONDS - t0)) "$line"
fi

# summary.md and summary.json
"$PYTHON" - "$steps" "$out" "$device" "$torch_v" "$cuda_v" "$triton_v" "$py_v" "$has_mm" "$sanitizer" \
    $((SECONDS - start)) <<'EOF'
import json, os, sys
steps_file, out, device, torch_v, cuda_v, triton_v, py_v, has_mm, sanitizer, wall = sys.argv[1:]
steps = [dict(step=a, status=b, seconds=int(c), detail=d)
         for a, b, c, d in (l.rstrip('\n').split('\t') for l in open(steps_file))]
env = dict(device=device, torch=torch_v, cuda=cuda_v, triton=None if triton_v == '-' else triton_v, python=py_v,
           mmengine=has_mm == 'yes', compute_sanitizer=sanitizer or None, wall_s=int(wall))
json.dump(dict(environment=env, steps=steps), open(os.path.join(out, 'summary.json'), 'w'), indent=1)
md = [f'# gpu_check on {device}', '',
      f'torch {torch_v} (CUDA {cuda_v}), triton {triton_v}, Python {py_v}; {wall} s in all.', '',
      '| step | result | seconds | detail |', '|---|---|---|---|']
md += [f"| {s['step']} | {s['status']} | {s['seconds']} | {s['detail']} |" for s in steps]
for name, title in (('benchmark.md', 'benchmarks/gpu.py'), ('detector.md', 'benchmarks/detector_step.py')):
    path = os.path.join(out, name)
    if os.path.exists(path):
        md += ['', f'## {title}', '', open(path).read()]
open(os.path.join(out, 'summary.md'), 'w').write('\n'.join(md) + '\n')
EOF
echo "gpu_check: results in $out ($((SECONDS - start)) s)"
! grep -q $'\tFAIL\t' "$steps"
