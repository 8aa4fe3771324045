#!/bin/bash
# What the landed decode loop has not had measured, one device call, adaptive to D seconds (default 560):
# with DeepGEMM's PyPI build for torch 2.11 carried in .whl (`pip download --no-deps -d .whl
# sgl-deep-gemm==0.1.4.post1 apache-tvm-ffi==0.1.11 --python-version 3.12 --only-binary :all: --platform
# manylinux2014_x86_64`), its GPU tests; the rollout (1.5B and 0.5B, 64 and 256 sequences) with jet+kv8 and jet on
# DeepGEMM beside bf16 and jet; a decode profile (1.5B x 64, bf16 and jet); bench/rl_step.py at HEAD and at c8fe8a8
# (the commit before 55c70f5's two-way launch, carried in .old: `mkdir .old && git archive c8fe8a8 jetrl bench |
# tar -x -C .old`); on an H200 the 8B shape at 64.
#   run(command="bash experiments/head-check/job.sh SECONDS [slim]", carry=[".whl", ".old"])
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=$OUT; T0=$SECONDS; D=${1:-560}
left() { echo $((D-(SECONDS-T0))); }
step() {  # step NAME MIN_SECONDS CMD...: run CMD with what is left (less 10 s) where at least MIN_SECONDS are
  local name=$1 need=$2; shift 2
  [ $(left) -lt $need ] && { echo "$name skipped ($(left)s left)" | tee -a $R/gpu.txt; return; }
  local S=$SECONDS; timeout $(( $(left) - 10 )) "$@" > /tmp/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-S))s" | tee -a $R/gpu.txt; tail -30 /tmp/$name.log > $R/$name.tail
}
{ nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } | tee $R/gpu.txt
H200=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -c H200)
ARMS=bf16,jet,jet+kv8
if ls .whl/*.whl > /dev/null 2>&1; then
  pip install -q --no-deps --target /tmp/dg .whl/*.whl > $R/dg_install.log 2>&1
  export PYTHONPATH=/tmp/dg:$PWD CUDA_HOME=${CUDA_HOME:-$(dirname $(dirname $(which nvcc)))} DG_JIT_USE_NVRTC=0 \
    DG_JIT_CACHE_DIR=/tmp/dgcache
  step dg_tests 100 python -m pytest -m gpu -q -p no:cacheprovider -rs tests/quant/test_deepgemm_gpu.py \
    tests/quant/test_deepgemm_route.py
  grep -m5 FAILED /tmp/dg_tests.log
  ARMS="$ARMS,jet@gemm=deepgemm"
fi
if [ "$2" = slim ]; then  # little device time left: DeepGEMM against the default route at 1.5B only
  step rollout 100 python bench/rollout.py --shape 1.5b --settings b64,b256 --arms "${ARMS/,jet+kv8/}" \
    --json $R/rollout.json
else
  step rollout 150 python bench/rollout.py --shape 1.5b,0.5b --settings b64,b256 --arms "$ARMS" --json $R/rollout.json
fi
step profile 90 python bench/decode_profile.py --shape 1.5b --batches 64 --arms bf16,jet --start 400 --top 25 \
  --json $R/profile.json
step rl_head 100 python bench/rl_step.py --layers 6 --steps 3 --json $R/rl_head.json
step rl_old 100 env PYTHONPATH=$PWD/.old python .old/bench/rl_step.py --layers 6 --steps 3 --json $R/rl_old.json
[ "$H200" = 1 ] && step rollout8b 100 python bench/rollout.py --shape 8b --settings b64 --arms bf16,jet \
  --json $R/rollout8b.json
python - <<'PY'
import json, os
R = os.environ["OUT"]
for name in ("rollout", "rollout8b"):
    try: rows = json.load(open(f"{R}/{name}.json"))
    except Exception as e: print(name, "missing", e); continue
    for r in rows:
        t, f, o = r["decode_tokens_per_s"], r["decode_roofline_fraction"], r["over_bf16"]
        print(name, r["shape"], r["setting"], "  ".join(f"{a} {t[a]:,.0f} ({f[a]:.1%}, {o.get(a, 1):.3f}x)" for a in t))
for name in ("rl_head", "rl_old"):
    try: print(name, "\n".join(open(f"{R}/{name}.tail").read().strip().splitlines()[-14:]))
    except Exception as e: print(name, "missing", e)
PY
