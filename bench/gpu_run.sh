#!/usr/bin/env bash
# One run on a GPU machine that reaches no package index (`make gpu`, after `make gpu-prep` on a
# machine that does; .gpu/ travels with the checkout). In order, each step with its own time
# limit, everything logged as it goes so a run cut short still returns what it measured:
#   1. what the machine has (GPU, torch, Triton, torch's flash attention schema);
#   2. the wheels it lacks, then samcache built with its CUDA kernels;
#   3. every CUDA test file in its own pytest process (a crash ends one file, not the run), while
#      the 7B-size random checkpoint is built on the GPU; then the timing-sensitive transfer test;
#   4. the benchmarks, the most asked-for first: attention, paged KV (swaps), the engine on the
#      7B-size checkpoint and its profile, KV quantisation, token merge, RoPE, the tiny engine.
# Results: $OUT/summary.md (the tables), $OUT/results.tgz (every log and JSON).
set -uo pipefail
OUT=${OUT:-$PWD/bench/out/gpu}
mkdir -p "$OUT"
LOG=$(mktemp -d)/gpu-run
mkdir -p "$LOG"
PY=${GPU_PY:-python3}
CKPT=${GPU_7B:-/tmp/samcache-qwen2.5-vl-7b}
START=$(date +%s)
export PYTHONUNBUFFERED=1 SAMCACHE_HYPOTHESIS_PROFILE=dev

elapsed() { echo $(( $(date +%s) - START )); }
pack() { tar czf "$OUT/results.tgz" -C "$(dirname "$LOG")" "$(basename "$LOG")" 2>/dev/null; }
# step NAME SECONDS CMD...: run with a time limit, log to $LOG/NAME.txt, record the status.
step() {
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout --kill-after=5 "$limit" "$@" > "$LOG/$name.txt" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s (at $(elapsed)s)" | tee -a "$LOG/steps.txt"
  pack
  return $rc
}

# 1. the machine
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  $PY -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); \
print(torch.ops.aten._flash_attention_forward.default._schema); \
print('flash sdp', torch.backends.cuda.flash_sdp_enabled(), 'cudnn sdp', torch.backends.cuda.cudnn_sdp_enabled())"
  nproc; free -g | head -2
} > "$LOG/machine.txt" 2>&1
cat "$LOG/machine.txt"

# 2. install and build. The image's default compiler (CXX=/opt/gcc/bin/g++, a wrapper around the
# same GCC 13) builds an extension whose iostream code crashes against the libstdc++ the process
# loads: every error message that formats an integer (TORCH_CHECK's c10::str) segfaulted. The
# system g++ does not.
if [ -x /usr/bin/g++ ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc CUDAHOSTCXX=/usr/bin/g++; fi
step install 240 bash -c "
  $PY -m pip install -q --no-index --no-deps --upgrade .gpu/wheels/*.whl &&
  SAMCACHE_CUDA=on SAMCACHE_XXHASH_INCLUDE=$PWD/.gpu/include MAX_JOBS=16 CMAKE_BUILD_PARALLEL_LEVEL=16 \
    $PY -m pip install -q --no-build-isolation --no-deps . &&
  cd /tmp && $PY -c 'import samcache; assert samcache._C.with_cuda, \"no CUDA kernels in the build\"; print(\"samcache with CUDA kernels\")'
" || { tail -40 "$LOG/install.txt"; exit 1; }

# 3. CUDA tests, one process per file (4 at a time), the checkpoint built beside them
( step checkpoint 180 $PY -c "
import torch
torch.set_default_device('cuda')
from samcache.random_checkpoints import build_preset
build_preset('qwen2_5_vl', 'qwen2.5-vl-7b', '$CKPT.tmp', dtype='bfloat16')
" && rm -rf "$CKPT" && mv "$CKPT.tmp" "$CKPT" ) &
BUILD_PID=$!
mkdir -p "$LOG/tests"
FILES=$(grep -l "mark.cuda" tests/test_*.py | grep -v test_transfer.py)
printf '%s\n' $FILES | xargs -P 4 -I{} bash -c \
  'f={}; n=$(basename $f .py); timeout --kill-after=5 200 '"$PY"' -m pytest -q -m cuda -p no:cacheprovider "$f" > '"$LOG"'/tests/$n.txt 2>&1; echo "$n rc=$?" >> '"$LOG"'/tests/status.txt'
wait $BUILD_PID
timeout --kill-after=5 120 $PY -m pytest -q -m cuda -p no:cacheprovider tests/test_transfer.py > "$LOG/tests/test_transfer.txt" 2>&1
echo "test_transfer rc=$?" >> "$LOG/tests/status.txt"
echo "tests done (at $(elapsed)s)" | tee -a "$LOG/steps.txt"
pack

# 4-5. benchmarks (nothing else running), the most asked-for first: a run cut short keeps those.
step bench-attention 150 $PY bench/bench_sparse_attention.py --device cuda --json "$LOG/attention.json"
step bench-paged_kv 60 $PY bench/bench_paged_kv.py --device cuda
if [ -f "$CKPT/config.json" ]; then
  step bench-engine-7b 200 $PY bench/bench_engine.py --device cuda --model "$CKPT" --dtype bfloat16 --reps 3 \
    --no-calibrate --sweep 0 0.05 1 --kv-cache-mib 16384 --json "$LOG/engine-7b.json"
  step profile-engine-7b 120 $PY bench/profile_engine.py --device cuda --model "$CKPT" --dtype bfloat16 --kv-cache-mib 8192
  # The same turns with the model's own norm and RoPE modules: what the fused layer kernels give.
  step bench-engine-7b-unfused 150 $PY bench/bench_engine.py --device cuda --model "$CKPT" --dtype bfloat16 --reps 3 \
    --no-calibrate --sweep 0.05 --kv-cache-mib 16384 --unfused-layer --json "$LOG/engine-7b-unfused.json"
fi
for b in kv_quant token_merge rope; do
  step "bench-$b" 60 $PY "bench/bench_$b.py" --device cuda
done
step bench-engine-tiny 90 $PY bench/bench_engine.py --device cuda --dtype bfloat16 --reps 5 --json "$LOG/engine-tiny.json"

# The summary: step status, test outcomes, the benchmark tables.
{
  echo "# GPU run $(date -u +%F) ($(elapsed) s)"; echo; head -3 "$LOG/machine.txt"; echo
  echo "## steps"; cat "$LOG/steps.txt"; echo
  echo "## tests"; sort "$LOG/tests/status.txt"
  for f in "$LOG"/tests/*.txt; do case $f in */status.txt) ;; *) tail -n 1 "$f" | sed "s|^|$(basename "$f" .txt): |";; esac; done
  grep -h -E "^(FAILED|ERROR)|Fatal Python error|Segmentation" "$LOG"/tests/*.txt | head -40
  for s in bench-attention bench-paged_kv bench-engine-7b profile-engine-7b bench-engine-7b-unfused bench-kv_quant bench-token_merge bench-rope bench-engine-tiny; do
    [ -f "$LOG/$s.txt" ] && { echo; echo "## $s"; grep -v "^\s*$" "$LOG/$s.txt" | grep -v Warning | tail -40; }
  done
} > "$OUT/summary.md" 2>&1
pack
cat "$OUT/summary.md"
