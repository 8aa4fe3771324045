#!/bin/bash
# The in-kernel merge's smallest informative call (about 3 minutes): its bitwise GPU test, then the 64-sequence
# rollout with and without it (.old carried), alternating. Not enough to land it (gpu_job.sh is).
export PYTHONUNBUFFERED=1
R=$OUT; T0=$SECONDS; D=${1:-170}
left() { echo $((D-(SECONDS-T0))); }
nvidia-smi --query-gpu=name --format=csv,noheader
S=$SECONDS; PYTHONPATH=$PWD timeout 60 python -m pytest -m gpu -q -p no:cacheprovider -n 4 \
  tests/rollout/test_rollout_gpu.py -k "paged_decode" tests/quant/test_decode_attention_bits.py > $R/tests.log 2>&1
echo "tests rc=$? $((SECONDS-S))s: $(tail -1 $R/tests.log)"; grep -m5 FAILED $R/tests.log
for run in merge1 base1 merge2 base2; do S=$SECONDS
  [ $(left) -lt 30 ] && break
  case $run in base*) d=.old;; *) d=.;; esac
  (cd $d && PYTHONPATH=$PWD timeout $(( $(left) - 3 )) python bench/rollout.py --shape 1.5b,0.5b --settings b64 --arms bf16,jet \
    --json $R/ro_$run.json > /tmp/ro_$run.log 2>&1); echo "$run rc=$? $((SECONDS-S))s"
  python -c "
import json; d = json.load(open('$R/ro_$run.json'))
for r in d:
    t, f = r['decode_tokens_per_s'], r['decode_roofline_fraction']
    print('$run', r['shape'], r['setting'], 'bf16 %.0f (%.1f%%) jet %.0f (%.1f%%) jet/bf16 %.3f' % (t['bf16'], 100*f['bf16'], t['jet'], 100*f['jet'], r['over_bf16']['jet']))
" 2>/dev/null
done
