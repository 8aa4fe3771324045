"""The experiments' warm start alone: ``jetrl sft`` of the experiment model (``exp_common.GPU_SFT``) into a folder.

``scripts/exp_two_gpus.sh`` trains it once and hands the folder to every RL arm (``exp_rl.py --model``). A
script file rather than ``python -c`` / stdin: the held-out evaluation scores answers in worker processes,
which must re-import the main module.

    python scripts/exp_sft.py --out-dir /tmp/sft --steps 250      # GPU
    python scripts/exp_sft.py --out-dir /tmp/sft --smoke          # the tiny CPU model, in seconds
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import exp_common as common
from jetrl.sft import run_sft


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out-dir", required=True, help="folder for the checkpoint (it must not hold an earlier run)")
    p.add_argument("--steps", type=int, default=None, help="SFT steps (default: the config's)")
    p.add_argument("--seed", type=int, default=0, help="weight-init seed")
    p.add_argument("--smoke", action="store_true", help="the tiny CPU model")
    args = p.parse_args(argv)
    result = run_sft(common.sft_config(args.smoke, args.out_dir, steps=args.steps, seed=args.seed), progress=False)
    print(f"sft done: {result.seconds:.0f} s, final loss {result.final_loss:.4f}, "
          f"greedy accuracy {result.accuracy:.3f} -> {result.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
