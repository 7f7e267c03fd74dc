#!/usr/bin/env bash
# The sparse attention CUDA op on a lent GPU, in one short run: build it, its gpu tests, the
# GPU benchmark (results and one log under $OUT). .ci/gpu_check.sh runs the same steps among
# all the others.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/gpu-sparse}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null || exit 1
status=0
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "from deepspeed_ext.op_builder.all_ops import ALL_OPS; ALL_OPS['sparse_attention_cuda']().load(verbose=True); print('built')" || status=1
  workers=$(python3 -c "import xdist" 2>/dev/null && echo "-n 4")
  python3 -m pytest -q -p no:cacheprovider --tb=short $workers \
    tests/unit/ops/sparse_attention/test_ops_cuda.py || status=1
  timeout 300 python3 bench/sparse_attention_gpu.py --seqs ${SPARSE_SEQS:-16384} \
    --blocks ${SPARSE_BLOCKS:-128 64} --out "$OUT/sparse_attention_gpu.json" || status=1
} 2>&1 | tee "$OUT/gpu_sparse.log"
exit $status
