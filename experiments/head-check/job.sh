#!/bin/bash
# What the landed decode loop has not had measured, one device call, adaptive to D seconds (default 560):
# the rollout with jet+kv8 (1.5B, 64 and 256 sequences), a decode profile (1.5B x 64, bf16 and jet),
# bench/rl_step.py at HEAD and at c8fe8a8 (the commit before 55c70f5's two-way launch; its jetrl and bench carried in
# .old: `mkdir .old && git archive c8fe8a8 jetrl bench | tar -x -C .old`), and on an H200 the 8B shape at 64.
#   run(command="bash experiments/head-check/job.sh SECONDS", carry=[".old"])
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=$OUT; T0=$SECONDS; D=${1:-560}
left() { echo $((D-(SECONDS-T0))); }
step() {  # step NAME MIN_SECONDS CMD...: run CMD with what is left (less 10 s) where at least MIN_SECONDS are
  local name=$1 need=$2; shift 2
  [ $(left) -lt $need ] && { echo "$name skipped ($(left)s left)" | tee -a $R/gpu.txt; return; }
  local S=$SECONDS; timeout $(( $(left) - 10 )) "$@" > /tmp/$name.log 2>&1
  echo "$name rc=$? $((SECONDS-S))s" | tee -a $R/gpu.txt; tail -25 /tmp/$name.log > $R/$name.tail
}
{ nvidia-smi --query-gpu=name --format=csv,noheader; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } | tee $R/gpu.txt
H200=$(nvidia-smi --query-gpu=name --format=csv,noheader | grep -c H200)
step rollout 120 python bench/rollout.py --shape 1.5b --settings b64,b256 --arms bf16,jet,jet+kv8 --json $R/rollout.json
step profile 90 python bench/decode_profile.py --shape 1.5b --batches 64 --arms bf16,jet --start 400 --top 25 \
  --json $R/profile.json
step rl_head 120 python bench/rl_step.py --layers 6 --steps 3 --json $R/rl_head.json
step rl_old 120 env PYTHONPATH=$PWD/.old python .old/bench/rl_step.py --layers 6 --steps 3 --json $R/rl_old.json
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
    try: print(name, open(f"{R}/{name}.tail").read().strip().splitlines()[-8:])
    except Exception as e: print(name, "missing", e)
PY
