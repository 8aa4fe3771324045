#!/bin/bash
# GPU tests of the two-way PDL and the fused o-projection quantization, then rollout A/B:
# base (.old = a6e4aad), pdl (.pdl = a6e4aad + two-way-pdl.patch), fused (working tree: pdl + gemm_act), alternating
export PYTHONUNBUFFERED=1
R=$OUT
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $R/gpu.txt
S=$SECONDS; PYTHONPATH=$PWD timeout 120 python -m pytest -q -p no:cacheprovider -m gpu -n 8 tests/quant/test_decode_gemm_pdl_gpu.py tests/quant/test_kernels_gpu.py -k "pdl or quantizing_its or decode_gemm_variants or grouped_decode" > $R/tests_new.log 2>&1; echo "new tests rc=$? $((SECONDS-S))s" >> $R/gpu.txt
for run in base1 pdl1 fused1 base2 pdl2 fused2; do S=$SECONDS
  case $run in base*) d=.old;; pdl*) d=.pdl;; *) d=.;; esac
  (cd $d && PYTHONPATH=$PWD timeout 85 python bench/rollout.py --shape 1.5b,0.5b --settings b64,b256 --arms bf16,jet --json $R/ro_$run.json > $R/ro_$run.log 2>&1); echo "$run rc=$? $((SECONDS-S))s" >> $R/gpu.txt
done
left=$((540-SECONDS)); S=$SECONDS
[ $left -gt 50 ] && PYTHONPATH=$PWD timeout $left python bench/decode_profile.py --shape 1.5b --batches 64 --arms bf16,jet --start 400 --top 30 --json $R/prof15_b64_fused.json > $R/prof15_b64_fused.log 2>&1; echo "profile rc=$? $((SECONDS-S))s" >> $R/gpu.txt
cat $R/gpu.txt; tail -3 $R/tests_new.log
python - <<'PY'
import json, os
R = os.environ["OUT"]
for run in ["base1", "pdl1", "fused1", "base2", "pdl2", "fused2"]:
    try: d = json.load(open(f"{R}/ro_{run}.json"))
    except Exception as e: print(run, "missing", e); continue
    for r in d:
        t = r["decode_tokens_per_s"]; o = r["over_bf16"]
        print(f"{run:6s} {r['shape']:5s} {r['setting']:5s} bf16 {t['bf16']:8.0f} jet {t['jet']:8.0f} jet/bf16 {o['jet']:.3f}")
PY
python - <<'PY'
import json, os
try: d = json.load(open(os.environ["OUT"] + "/prof15_b64_fused.json"))
except Exception as e: print("profile missing", e); raise SystemExit
for r in d["results"]:
    print(f"== {r['arm']} ms/step {r['ms_per_step']:.3f} busy {r['gpu_busy_ms']:.3f} kernel {r['kernel_ms']:.3f} ops {r['gpu_ops_per_step']}")
    for k in r["top_kernels"][:12]:
        print(f"  {k[2]:8.1f} us/step {int(k[3]):4d} {k[1]:12s} {k[0][:70]}")
PY
