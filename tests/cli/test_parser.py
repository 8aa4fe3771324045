"""The command line's choice lists are the registries' (no copies), and a bad choice is a usage error."""

import pytest

from jetrl.cli import build_parser
from jetrl.config import DTYPES
from jetrl.data import DATASET_FORMATS, TASKS
from jetrl.quant.recipe import RECIPES


def _choices(command: str, option: str) -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._subparsers._group_actions).choices[command]  # type: ignore[union-attr]
    return list(next(a for a in sub._actions if option in a.option_strings).choices)


def test_choices_come_from_the_registries():
    for command in ("train", "eval", "generate"):
        assert _choices(command, "--recipe") == list(RECIPES)
    assert _choices("eval", "--dtype") == list(DTYPES)
    assert _choices("eval", "--format") == sorted(DATASET_FORMATS)
    assert _choices("eval", "--task") == _choices("sft", "--task") == sorted(TASKS)


def test_unknown_choice_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["eval", "--recipe", "fp4"])
    assert done.value.code == 2 and "invalid choice: 'fp4'" in capsys.readouterr().err


def test_sft_takes_the_device_dtype_and_packing_of_its_config():
    args = build_parser().parse_args(["sft", "--device", "cpu", "--dtype", "bfloat16", "--packing",
                                      "--micro-batch-tokens", "4096"])
    assert (args.device, args.dtype, args.packing, args.micro_batch_tokens) == ("cpu", "bfloat16", True, 4096)
    defaults = build_parser().parse_args(["sft"])
    assert defaults.packing is None and defaults.dtype == "float32"  # None: packed on CUDA only
    assert build_parser().parse_args(["sft", "--no-packing"]).packing is False


def test_sft_on_a_missing_gpu_is_one_clear_error(capsys, tmp_path):
    import torch

    from jetrl.cli import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["sft", "--device", "cuda", "--output-dir", str(tmp_path / "o"), "--steps", "1"]) == 2
    assert "device 'cuda' was asked for" in capsys.readouterr().err
