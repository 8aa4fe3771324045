#!/bin/bash
# gemm=auto on DeepGEMM where it loads: the GPU tests that route FP8 GEMMs, with sgl-deep-gemm 0.1.4.post1 (torch
# 2.11's build, carried in .whl: see experiments/head-check/job.sh) on the path, then `jetrl train` as a user runs it
# (bench/train_run.py, 0.5B, responses to max_tokens): bf16 and jet (auto: DeepGEMM), then jet on the default route
# without it (deepgemm_decode_max_m=0), on the same machine. D seconds in all (default 560).
#   run(command="bash experiments/auto-deepgemm/job.sh SECONDS", carry=[".whl"])
export PYTHONUNBUFFERED=1
R=$OUT; T0=$SECONDS; D=${1:-560}
left() { echo $((D-(SECONDS-T0))); }
step() {  # step NAME MIN_SECONDS MAX_SECONDS CMD...
  local name=$1 need=$2 most=$3; shift 3
  [ $(left) -lt $need ] && { echo "$name skipped ($(left)s left)" | tee -a $R/gpu.txt; return; }
  local t=$(( $(left) - 10 )); [ $t -gt $most ] && t=$most
  local S=$SECONDS; timeout $t "$@" > /tmp/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-S))s" | tee -a $R/gpu.txt; tail -25 /tmp/$name.log > $R/$name.tail
}
{ nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; git log -1 --format=%h 2>/dev/null; } | tee $R/gpu.txt
pip install -q --no-deps --target /tmp/dg .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=/tmp/dg:$PWD CUDA_HOME=${CUDA_HOME:-$(dirname $(dirname $(which nvcc)))} DG_JIT_USE_NVRTC=0 \
  DG_JIT_CACHE_DIR=/tmp/dgcache
python -c "from jetrl.quant.kernels import gemm_deepgemm as d, tuning; import torch; print('deepgemm loads', d.is_available(torch.device('cuda')), 'auto uses it', tuning.current().uses_deepgemm(lambda: d.is_available(torch.device('cuda'))))" | tee -a $R/gpu.txt
step tests 100 130 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/quant/test_deepgemm_gpu.py \
  tests/quant/test_kernels_gpu.py::test_decode_routing_bounds tests/quant/test_seam.py tests/rollout/test_rollout_gpu.py
grep -E "passed|failed|FAILED" /tmp/tests.log | tail -8 | tee -a $R/gpu.txt
step train_dg 100 150 python bench/train_run.py --shape qwen2.5-0.5b --setting to-max --steps 4 --recipes bf16,jet \
  --json $R/train_dg.json
step train_default 60 90 python bench/train_run.py --shape qwen2.5-0.5b --setting to-max --steps 4 --recipes jet \
  --set kernels=deepgemm_decode_max_m=0 --json $R/train_default.json
for f in train_dg train_default; do echo "== $f"; grep -v "^\[" /tmp/$f.log | tail -14; done
