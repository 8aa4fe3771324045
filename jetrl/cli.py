"""The ``jetrl`` command line: thin parsing over importable functions."""

from __future__ import annotations

import argparse
import sys


def _cmd_check_fp8(args: argparse.Namespace) -> int:
    from jetrl.quant.selfcheck import check_fp8_linear

    result = check_fp8_linear(args.m, args.n, args.k, device=args.device)
    width = max(len(name) for name, _ in result.rows())
    print("FP8Linear (jet: FP8 Fprop/DGrad/WGrad) vs BF16 nn.Linear, random data")
    for name, value in result.rows():
        print(f"  {name:<{width}}  {value}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jetrl", description="RL of LLMs with a unified FP8 precision flow")
    sub = parser.add_subparsers(dest="command")
    check = sub.add_parser("check-fp8", help="FP8Linear vs BF16 on random data: error, and speed on a GPU")
    check.add_argument("--m", type=int, default=512, help="tokens")
    check.add_argument("--n", type=int, default=768, help="out features")
    check.add_argument("--k", type=int, default=1024, help="in features")
    check.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    check.set_defaults(func=_cmd_check_fp8)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # the main job on its embedded default
        args = parser.parse_args(["check-fp8"])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
