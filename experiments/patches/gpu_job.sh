#!/bin/bash
# One device call for the next session (about 8 minutes on an H100 or H200). Before it, on this machine:
#   rm -rf .old && mkdir .old && git archive HEAD | tar -x -C .old    # the base, carried: run(carry=[".old"])
#   git apply experiments/patches/in-kernel-merge.patch                # the working tree: base + patch
# (.old must be listed in .git/info/exclude.) Then: run(command="bash experiments/patches/gpu_job.sh", carry=[".old"]).
export PYTHONUNBUFFERED=1
R=$OUT; T0=$SECONDS
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > $R/gpu.txt
S=$SECONDS; PYTHONPATH=$PWD timeout 200 python -m pytest -m gpu -q -p no:cacheprovider -n 8 tests/rollout tests/models \
  tests/quant/test_decode_attention_bits.py tests/quant/test_decode_attention_configs.py \
  tests/quant/test_decode_attention_variants.py tests/quant/test_kv_fp8_kernels.py > $R/tests.log 2>&1
echo "tests rc=$? $((SECONDS-S))s: $(tail -1 $R/tests.log)" >> $R/gpu.txt
for run in merge1 base1 merge2 base2; do S=$SECONDS
  case $run in base*) d=.old;; *) d=.;; esac
  (cd $d && PYTHONPATH=$PWD timeout 80 python bench/rollout.py --shape 1.5b,0.5b --settings b64,b256 --arms bf16,jet \
    --json $R/ro_$run.json > $R/ro_$run.log 2>&1); echo "$run rc=$? $((SECONDS-S))s" >> $R/gpu.txt
done
L=$((540-(SECONDS-T0))); S=$SECONDS
[ $L -gt 40 ] && { PYTHONPATH=$PWD timeout $L python -m pytest -m gpu -q -p no:cacheprovider -n 2 tests/exact \
  > $R/exact.log 2>&1; echo "exact rc=$? $((SECONDS-S))s: $(tail -1 $R/exact.log)" >> $R/gpu.txt; }
grep -h FAILED $R/tests.log $R/exact.log | head; cat $R/gpu.txt
python - <<'PY'
import json, os
R = os.environ["OUT"]
for run in ["merge1", "base1", "merge2", "base2"]:
    try: d = json.load(open(f"{R}/ro_{run}.json"))
    except Exception as e: print(run, "missing", e); continue
    for r in d:
        t, o, f = r["decode_tokens_per_s"], r["over_bf16"], r["decode_roofline_fraction"]
        print(f"{run:6s} {r['shape']:5s} {r['setting']:5s} bf16 {t['bf16']:8.0f} ({f['bf16']:.1%}) jet {t['jet']:8.0f} ({f['jet']:.1%}) jet/bf16 {o['jet']:.3f}")
PY
