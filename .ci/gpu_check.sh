#!/usr/bin/env bash
# Everything in the project that needs a CUDA GPU, in one run (CI has none): the CUDA op
# builds, every gpu-marked test, the GPU benchmarks and the main job on the GPU. One log
# ($OUT/gpu_check.log, every step under its own header) and the benchmarks' JSON go to $OUT
# (default /tmp/gpu-check): few files, as the device tool brings back at most 8. Assumes torch
# with CUDA is installed; pass wheels for missing Python packages in .whl/ (installed offline
# into /tmp/site). A shorter run for one change: GPU_OPS (ops to build), GPU_TESTS (pytest
# paths), BENCHES (any of: fused_adam transformer sparse), SKIP_MAIN=1.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 1
export PATH="$PWD/bin:$PATH"
status=0
LOG="$OUT/gpu_check.log"
: >"$LOG"
step() { # name, command...: runs one step into the log, prints its tail, remembers a failure
  local name=$1
  shift
  local t0=$SECONDS part
  part=$(mktemp)
  "$@" >"$part" 2>&1
  local rc=$?
  { echo "===== $name: rc=$rc in $((SECONDS - t0)) s"; cat "$part"; } >>"$LOG"
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n 15 "$part"
  rm -f "$part"
  [ $rc -eq 0 ] || status=1
}

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  nvcc --version | tail -n 2
} | tee -a "$LOG"

# The CUDA ops build side by side (the build lock keeps each op to one builder).
build() {
  python3 -c "from deepspeed_ext.op_builder.all_ops import ALL_OPS; ALL_OPS['$1']().load(verbose=False); print('built $1')"
}
build_all() { # every CUDA op at once; fails when any build fails
  local pids=() rc=0 op pid
  for op in ${GPU_OPS:-fused_adam fused_lamb fused_lion packbits_cuda transformer_cuda sparse_attention_cuda}; do
    build "$op" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  return $rc
}
step builds build_all
step ds_report ds_report
# xdist (where installed) keeps a crashing test from taking the rest of the run with it
workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
# shellcheck disable=SC2086
step gpu_tests python3 -m pytest -q -m gpu ${GPU_TESTS:-tests} -p no:cacheprovider --tb=short $workers
benches=" ${BENCHES:-fused_adam transformer sparse} "
if [ -z "${SKIP_BENCH:-}" ]; then
  # the tests' xdist workers leave a load average of 11-15 behind: let it settle first
  sleep "${BENCH_SETTLE_S:-45}"
  if [[ $benches == *" fused_adam "* ]]; then
    step fused_adam_bench python3 bench/fused_adam.py --out "$OUT/fused_adam.json"
  fi
  if [[ $benches == *" transformer "* ]]; then
    step transformer_layer_bench python3 bench/transformer_layer.py --out "$OUT/transformer_layer_bert_base.json"
    step transformer_layer_bench_large python3 bench/transformer_layer.py --hidden 1024 --heads 16 \
      --batch 64 --out "$OUT/transformer_layer_bert_large.json"
  fi
  if [[ $benches == *" sparse "* ]]; then
    step sparse_attention_gpu_bench timeout 300 python3 bench/sparse_attention_gpu.py \
      --seqs ${SPARSE_SEQS:-16384} --blocks ${SPARSE_BLOCKS:-128 64} --profile --out "$OUT/sparse_attention_gpu.json"
  fi
fi
[ -n "${SKIP_MAIN:-}" ] && exit $status
step main_job timeout 300 python3 examples/train_tiny_gpt.py --steps 200 --out /tmp/gpu-main
step main_job_zero3_bf16 timeout 300 python3 examples/train_tiny_gpt.py --steps 200 --zero-stage 3 --bf16 --out /tmp/gpu-main3
exit $status
