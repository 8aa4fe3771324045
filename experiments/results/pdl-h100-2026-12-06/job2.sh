#!/bin/bash
# rollout A/B: A = working tree (two-way PDL; norm/SwiGLU as dependents only when they quantize), B = A without RoPE's
# wait (.pdlB), base = a6e4aad (.old); then GPU tests of A
export PYTHONUNBUFFERED=1
R=$OUT; T0=$SECONDS
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/gpuB.txt
for run in A1 base1 B1; do S=$SECONDS
  case $run in base*) d=.old;; B*) d=.pdlB;; *) d=.;; esac
  (cd $d && PYTHONPATH=$PWD timeout 75 python bench/rollout.py --shape 1.5b,0.5b --settings b64,b256 --arms bf16,jet --json $R/ro_$run.json > $R/ro_$run.log 2>&1); echo "$run rc=$? $((SECONDS-S))s" >> $R/gpuB.txt
done
export PYTHONPATH=$PWD
S=$SECONDS; timeout 170 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/quant/test_decode_gemm_pdl_gpu.py tests/quant/test_kernels_gpu.py tests/quant/test_swiglu.py tests/quant/test_norm.py tests/quant/test_grouped_linear.py tests/models/test_rope.py tests/models/test_models_gpu.py tests/models/test_cuda_graphs.py tests/quant/test_seam.py tests/rollout > $R/gpu_tests_B.log 2>&1; echo "tests rc=$? $((SECONDS-S))s: $(tail -1 $R/gpu_tests_B.log)" >> $R/gpuB.txt
S=$SECONDS; L=$((390-(SECONDS-T0)))
[ $L -gt 30 ] && { timeout $L python -m pytest -m gpu -q -p no:cacheprovider -n 2 tests/exact > $R/gpu_exact_B.log 2>&1; echo "exact rc=$? $((SECONDS-S))s: $(tail -1 $R/gpu_exact_B.log)" >> $R/gpuB.txt; }
grep -h FAILED $R/gpu_tests_B.log $R/gpu_exact_B.log | head -20
cat $R/gpuB.txt
python - <<'PY'
import json, os
R = os.environ["OUT"]
for run in ["A1", "base1", "B1"]:
    try: d = json.load(open(f"{R}/ro_{run}.json"))
    except Exception as e: print(run, "missing", e); continue
    for r in d:
        t = r["decode_tokens_per_s"]; o = r["over_bf16"]
        print(f"{run:6s} {r['shape']:5s} {r['setting']:5s} bf16 {t['bf16']:8.0f} jet {t['jet']:8.0f} jet/bf16 {o['jet']:.3f}")
PY
mkdir -p $R/keep && cp $R/gpuB.txt $R/keep/
