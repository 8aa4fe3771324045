#!/bin/bash
# H100: the 8B-shape RL step, 8 of 32 blocks (fits 80 GB), before the consolidation (8e377c7, in .old) and at HEAD;
# then the GPU tests of the changes not yet run on a GPU (Gluon quantizer wraps, tokens_run[-1])
export PYTHONUNBUFFERED=1
T0=$SECONDS
R=$OUT; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > $R/gpu4.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $R/gpu4.txt
S=$SECONDS
(cd .old && PYTHONPATH=$PWD timeout 250 python bench/rl_step.py --layers 6 --json $R/rl_step6_8e377c7.json > $R/rl_step6_8e377c7.log 2>&1); echo "old rc=$? $((SECONDS-S))s" >> $R/gpu4.txt
S=$SECONDS
PYTHONPATH=$PWD timeout 250 python bench/rl_step.py --layers 6 --json $R/rl_step6_head.json > $R/rl_step6_head.log 2>&1; echo "head rc=$? $((SECONDS-S))s" >> $R/gpu4.txt
left=0
S=$SECONDS
[ $left -gt 40 ] && PYTHONPATH=$PWD timeout $left python -m pytest -q -p no:cacheprovider -m gpu tests/quant/test_kernels_gpu.py tests/quant/test_swiglu.py tests/rollout -n 8 > $R/gpu_tests.log 2>&1; echo "tests rc=$? $((SECONDS-S))s" >> $R/gpu4.txt
cat $R/gpu4.txt; tail -2 $R/gpu_tests.log
for f in 8e377c7 head; do echo "== $f"; tail -12 $R/rl_step6_$f.log; done
