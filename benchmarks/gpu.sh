#!/usr/bin/env bash
# The GPU checks and measurements, as one script for a machine with a CUDA GPU (CI has none).
#
#   bash benchmarks/gpu.sh            # logs and JSON lines under $OUT (default /tmp/cascade-gpu)
#
# Runs tests/test_cuda.py (the CUDA / NCCL paths against CPU references), then
# benchmarks/train.py (packed trainer vs transformers: tiny-moe and small-moe in fp32, small-moe in
# bf16 with the varlen attention kernel and without it) and benchmarks/ttc.py's prefix-reuse
# comparison on cuda. PARTS="test_cuda train_small_bf16 ..." picks some. Uses the python3 on PATH with the torch
# already installed there; packages it lacks can be put as wheels in .whl/ (installed with
# --no-deps into /tmp/site). Each part has its own time limit, so one hang costs only its share.
set -u
OUT=${OUT:-/tmp/cascade-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
nvidia-smi -L
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"

part() {  # part NAME SECONDS CMD...: run CMD under a time limit, log to $OUT/NAME.log, keep going
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$secs" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || FAILED=1
  echo "== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
  grep -E '^\{|^# beta|passed|failed|error|max \|param|mismatch_kl per|version_lag_max per' "$OUT/$name.log" | tail -n 12 \
    | cut -c1-1500 | tee -a "$OUT/summary.txt"
}

PARTS=${PARTS:-test_cuda train_tiny train_small train_small_bf16 train_small_bf16_loop ttc_prefix}
want() { [[ " $PARTS " == *" $1 "* ]]; }
sel=(); [ -z "${TEST_K:-}" ] || sel=(-k "$TEST_K")  # TEST_K: a pytest -k selection
T=${TRAIN_S:-100}
want test_cuda && part test_cuda "${TEST_S:-240}" python3 -m pytest tests/test_cuda.py -v -s -p no:cacheprovider "${sel[@]}"
want train_tiny && part train_tiny "$T" python3 benchmarks/train.py --device cuda --preset tiny-moe --repeats 5
want train_small && part train_small "$T" python3 benchmarks/train.py --device cuda --preset small-moe --repeats 3
# bf16: the packed attention as one varlen FlashAttention call, then as one SDPA call per sequence
want train_small_bf16 && part train_small_bf16 "$T" python3 benchmarks/train.py --device cuda --dtype bfloat16 \
  --preset small-moe --repeats 3
want train_small_bf16_loop && CASCADE_VARLEN=0 part train_small_bf16_loop "$T" python3 benchmarks/train.py \
  --device cuda --dtype bfloat16 --preset small-moe --repeats 3 --only train
# the torch engine on cuda decodes a tiny model step by step (launch-bound): one repeat, no long problem
want ttc_prefix && part ttc_prefix "${TTC_S:-240}" python3 benchmarks/ttc.py --device cuda --skip-concurrency --repeats 1 \
  --long-problem-words 0
exit "${FAILED:-0}"
