#!/bin/bash
# H100: the 8B-shape RL step, 6 of 32 blocks, 3 timed steps, head / 8e377c7 / head / 8e377c7 alternating
export PYTHONUNBUFFERED=1
R=$OUT
for run in head1 old1 head2 old2; do S=$SECONDS
  if [[ $run == old* ]]; then d=.old; else d=.; fi
  (cd $d && PYTHONPATH=$PWD timeout 120 python bench/rl_step.py --layers 6 --steps 3 --json $R/rl6_$run.json > $R/rl6_$run.log 2>&1); echo "$run rc=$? $((SECONDS-S))s"
  grep -E "^(rollout|update|total) " $R/rl6_$run.log
done
