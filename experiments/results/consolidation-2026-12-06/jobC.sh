#!/usr/bin/env bash
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
R=$OUT; nvidia-smi --query-gpu=name --format=csv,noheader > $R/summary.txt; T0=$SECONDS; S=$SECONDS
timeout 90 python -m pytest -q -p no:cacheprovider tests/parallel -n 8 > $R/parallel.log 2>&1; echo "parallel rc=$? $((SECONDS-S))s: $(tail -1 $R/parallel.log)" >> $R/summary.txt
S=$SECONDS
timeout $((200-(SECONDS-T0))) python -m pytest -m gpu -q -p no:cacheprovider tests/exact -n 2 > $R/exact.log 2>&1; echo "exact gpu rc=$? $((SECONDS-S))s: $(tail -1 $R/exact.log)" >> $R/summary.txt
grep -E "FAILED|Error:" $R/parallel.log $R/exact.log | head -10
cat $R/summary.txt
