"""Which 128x1 kernel family the CUDA backend picks, and the Gluon wrappers' input checks.

Pure host logic (no kernel runs): the kernels themselves are checked bitwise on the GPU
(tests/quant/test_kernels_gpu.py); the Triton interpreter does not run Gluon.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

from jetrl.quant import cuda as cuda_mod  # noqa: E402
from jetrl.quant import token_gluon  # noqa: E402


def test_defaults_name_known_families():
    for name in ("TOKEN_KERNEL", "REQUANT_KERNEL", "FUSED_ACT_AND_TOKEN_KERNEL"):
        assert getattr(cuda_mod, name) in cuda_mod.TOKEN_KERNELS


@pytest.mark.parametrize("has_gluon", [True, False])
def test_gluon_falls_back_to_triton_without_gluon(monkeypatch, has_gluon):
    monkeypatch.setattr(token_gluon, "available", lambda: has_gluon)
    assert cuda_mod._kernel_choice("gluon", "TOKEN_KERNEL") == ("gluon" if has_gluon else "triton")
    assert cuda_mod._kernel_choice("triton", "TOKEN_KERNEL") == "triton"


def test_unknown_family_names_the_setting():
    with pytest.raises(ValueError, match="REQUANT_KERNEL must be one of"):
        cuda_mod._kernel_choice("cutlass", "REQUANT_KERNEL")


def test_gluon_takes_unit_stride_float_rows_only():
    x = torch.randn(256, 384, dtype=torch.bfloat16)
    assert cuda_mod._gluon_takes(x)
    assert cuda_mod._gluon_takes(x.float())
    assert not cuda_mod._gluon_takes(x.t())  # the two-kernel Triton route takes strided rows
    assert not cuda_mod._gluon_takes(x.to(torch.float64))


def test_available_is_a_bool():
    assert isinstance(token_gluon.available(), bool)


def test_sixteen_byte_loads_per_dtype():
    assert [token_gluon._vec(d) for d in (torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32)] == \
        [16, 8, 8, 4]


def test_gluon_wrappers_reject_bad_inputs_before_launching():
    x = torch.randn(256, 384, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        token_gluon.quantize_token_128x1(x.to(torch.int32))
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        token_gluon.quantize_act_and_token(x.to(torch.float64))
    with pytest.raises(ValueError, match="unit stride"):
        token_gluon.quantize_token_128x1(x.t())
    with pytest.raises(ValueError, match="unit stride"):
        token_gluon.quantize_act_and_token(x.t())
    with pytest.raises(ValueError, match="unit stride"):
        token_gluon.requantize_act_to_token(x.t().to(torch.float8_e4m3fn), torch.ones(384, 2))
