#!/bin/bash
# H100 at 4a26dab: where jet's decode step at 1.5B x 64 spends its time against bf16's (kernel list, start 400)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python bench/decode_profile.py --shape 1.5b --batches 64 --arms bf16,jet --start 400 --top 30 --json $OUT/prof15_b64.json > $OUT/prof15_b64.log 2>&1; echo rc=$?
tail -6 $OUT/prof15_b64.log
python - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/prof15_b64.json"))
for r in d["results"]:
    print(f"== {r['arm']} ms/step {r['ms_per_step']:.3f} busy {r['gpu_busy_ms']:.3f} kernel {r['kernel_ms']:.3f} ops {r['gpu_ops_per_step']}")
    for k in r["top_kernels"][:30]:
        print(f"  {k[2]:8.1f} us/step {int(k[3]):4d} {k[1]:12s} {k[0][:90]}")
PY
