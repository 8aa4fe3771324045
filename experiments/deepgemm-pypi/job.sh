#!/bin/bash
# DeepGEMM from PyPI through the rollout, one device call (about 6 minutes). Before it, on this machine:
#   mkdir -p .whl && pip download --no-deps -d .whl sgl-deep-gemm==0.1.4.post1 \
#     apache-tvm-ffi==0.1.11 --python-version 3.12 --only-binary :all: --platform manylinux_2_28_x86_64
# (0.1.4.post1 is the torch 2.11 build: docs/recipes.md; .whl must be in .git/info/exclude). Then:
#   run(command="bash experiments/deepgemm-pypi/job.sh SECONDS", carry=[".whl"])
# The DeepGEMM GPU tests, then bench/rollout.py with jet on DeepGEMM's decode GEMMs beside the default route, twice.
export PYTHONUNBUFFERED=1
R=$OUT; T0=$SECONDS; D=${1:-560}
left() { echo $((D-(SECONDS-T0))); }
{ nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } | tee $R/gpu.txt
pip install -q --no-deps --target /tmp/dg .whl/*.whl > $R/dg_install.log 2>&1
export PYTHONPATH=/tmp/dg:$PWD CUDA_HOME=${CUDA_HOME:-$(dirname $(dirname $(which nvcc)))} DG_JIT_USE_NVRTC=0 \
  DG_JIT_CACHE_DIR=/tmp/dgcache
S=$SECONDS; timeout 180 python -m pytest -m gpu -q -p no:cacheprovider -rs tests/quant/test_deepgemm_gpu.py \
  tests/quant/test_deepgemm_route.py > $R/dg_tests.log 2>&1
echo "deepgemm tests rc=$? $((SECONDS-S))s: $(tail -1 $R/dg_tests.log)" | tee -a $R/gpu.txt; grep -m5 FAILED $R/dg_tests.log
for run in 1 2; do S=$SECONDS
  [ $(left) -lt 100 ] && break
  timeout $(( $(left) - 10 )) python bench/rollout.py --shape 1.5b,0.5b --settings b64,b256 \
    --arms "bf16,jet,jet@gemm=deepgemm" --json $R/ro_$run.json > /tmp/ro_$run.log 2>&1
  echo "rollout $run rc=$? $((SECONDS-S))s" | tee -a $R/gpu.txt
done
python - <<'PY'
import json, os
R = os.environ["OUT"]
for run in (1, 2):
    try: rows = json.load(open(f"{R}/ro_{run}.json"))
    except Exception as e: print(run, "missing", e); continue
    for r in rows:
        t, f, o = r["decode_tokens_per_s"], r["decode_roofline_fraction"], r["over_bf16"]
        print(run, r["shape"], r["setting"], "  ".join(f"{a} {t[a]:,.0f} ({f[a]:.1%}, {o.get(a, 1):.3f}x)" for a in t))
PY
