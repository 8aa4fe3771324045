"""bench/profile_step.py on CPU: its kernel classification, and a clear refusal without a GPU."""

from __future__ import annotations

import pytest
import torch

from bench import profile_step


@pytest.mark.parametrize("name, kind", [
    ("_paged_decode_kernel", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma", "attention"),
    ("_quantize_rows_cols_kernel", "fp8 quant"),
    ("_requantize_act_to_token_kernel", "fp8 quant"),
    ("_fp8_decode_gemm_kernel", "gemm"),
    ("nvjet_sm90_qqtst_128x128_128x6_2x1_v_bz_coopA_algo2_Ablk128_Bvec128_TNN", "gemm"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, MeanOps>>", "norm/reduce"),
    ("void at::native::index_elementwise_kernel<128, 4, index_copy_kernel_impl>", "copy/index"),
    ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", "elementwise"),
    ("_rope_qk_kernel", "elementwise"),
    ("_add_bias_kernel", "elementwise"),
    ("_swiglu_bwd_kernel", "swiglu"),
    ("token_kernel", "fp8 quant"),  # the Gluon 128x1 (re-)quantization
    ("act_and_token_kernel", "fp8 quant"),
    ("_transpose_tiles_kernel", "copy/index"),  # DGrad's W^T from W's FP8 tiles
    ("_seeded_gumbel_sample_kernel", "other"),
])
def test_kernel_kinds(name, kind):
    assert profile_step.kind_of(name) == kind


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        profile_step.main(["--layers", "1"])


def test_shape_overrides_reach_the_model(monkeypatch):
    """--shape's fields replace the base shape's before any model is built; bad JSON is a usage error."""
    import jetrl.models

    built = []

    def fake_build(shape, **kw):
        built.append(dict(shape))
        raise RuntimeError("stop after the build")  # the shape is all this test needs

    monkeypatch.setattr(jetrl.models, "build_model", fake_build)
    with pytest.raises(RuntimeError, match="stop after the build"):
        profile_step.main(["--tiny", "--parts", "train", "--shape", '{"hidden_size": 64, "intermediate_size": 96}'])
    assert built[0]["hidden_size"] == 64 and built[0]["intermediate_size"] == 96
    for bad in ("{hidden_size: 1}", "[1, 2]"):
        with pytest.raises(SystemExit):
            profile_step.main(["--tiny", "--shape", bad])
