"""Which quantization kernels the CUDA backend picks (Gluon, or the Triton fallback), and the Gluon wrappers'
input checks.

Pure host logic (no kernel runs): the kernels themselves are checked bitwise on the GPU
(tests/quant/test_kernels_gpu.py); the Triton interpreter does not run Gluon.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton)", allow_module_level=True)

from jetrl.quant.kernels import cuda_backend as cuda_mod  # noqa: E402
from jetrl.quant.kernels import quantize_gluon as token_gluon  # noqa: E402
from jetrl.quant.kernels import tuning  # noqa: E402


@pytest.mark.parametrize("has_gluon", [True, False])
def test_gluon_falls_back_to_the_fastest_triton_path(monkeypatch, has_gluon):
    """Without Gluon (or with ``tuning.gluon`` off) grad_out takes the two Triton kernels (1x128, then 128x1),
    which beat the deleted Triton one-pass kernel; with Gluon the one-pass Gluon kernel."""
    monkeypatch.setattr(token_gluon, "available", lambda: has_gluon)
    x = torch.randn(256, 384, dtype=torch.bfloat16)
    assert cuda_mod.uses_gluon(x) == has_gluon
    assert cuda_mod.act_and_token_path(x) == ("gluon-one-pass" if has_gluon else "triton-two-kernels")
    with tuning.override(gluon=False):
        assert not cuda_mod.uses_gluon(x)
        assert cuda_mod.act_and_token_path(x) == "triton-two-kernels"


def test_gluon_takes_unit_stride_float_rows_only(monkeypatch):
    monkeypatch.setattr(token_gluon, "available", lambda: True)
    x = torch.randn(256, 384, dtype=torch.bfloat16)
    assert cuda_mod.act_and_token_path(x) == "gluon-one-pass"
    assert cuda_mod.act_and_token_path(x.float()) == "gluon-one-pass"
    assert cuda_mod.act_and_token_path(x.t()) == "triton-two-kernels"  # strided rows
    assert cuda_mod.act_and_token_path(x.to(torch.float64)) == "triton-two-kernels"
    assert not cuda_mod.uses_gluon(x.t().to(torch.float8_e4m3fn))  # the re-quantization's strided input


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
