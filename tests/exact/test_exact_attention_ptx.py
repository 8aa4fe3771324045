"""The exact attention kernels compiled for the H200 (sm_90a) on this CPU machine, no GPU needed: the tile kernel
and the swapped decode kernel issue Hopper MMAs (``wgmma``) of the shapes whose per-element arithmetic the GPU
tests (test_exact_gpu.py) check bitwise, and no ``mma.sync``, whose accumulation would differ."""

import importlib.util
import re
from collections import Counter

import pytest

from jetrl.quant.kernels.tuning import COMPILE_OPTIONS
from sm90_compile import skip_without_sm90_compiler

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton) ")

OPS = ("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16", "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
       "mma.sync")


def _ptx_ops() -> Counter:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jetrl.quant.kernels import exact_attention_triton as E

    kernel = E._exact_attention_kernel
    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "ks_ptr": "*bf16", "vs_ptr": "*bf16",
             "tables_ptr": "*i32", "qsl_ptr": "*i32", "ctx_ptr": "*i32", "tile_seq_ptr": "*i32",
             "tile_start_ptr": "*i32", "out_ptr": "*bf16", "scale_log2": "fp32"}
    consts = dict(GROUP=4, GROUP_P2=4, HEAD_DIM=128, PAGE=1, BLOCK_Q=16, BLOCK_D=128, BLOCK_N=64, IEEE=False,
                  FP8=False, WHILE_LOOP=False)
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4, num_stages=2, **COMPILE_OPTIONS))
    ptx = compiled.asm["ptx"]
    return Counter({op: len(re.findall(re.escape(op) + r"\b", ptx)) for op in OPS})


def test_tile_kernel_runs_hopper_mma():
    skip_without_sm90_compiler()
    ops = _ptx_ops()
    assert ops[OPS[0]] == 8 and ops[OPS[1]] == 4, ops  # K = 128 and 64 in steps of 16
    assert ops["mma.sync"] == 0, ops


@pytest.mark.parametrize("fp8", [False, True])
def test_decode_kernel_runs_hopper_mma_with_swapped_operands(fp8):
    """The swapped decode kernel (one query row per program) must issue Hopper MMAs, as the tile kernel does: a
    64-row ``wgmma`` with the heads as 16 columns for the scores (K = 128), the row sum and ``V^T @ P^T`` (K =
    64), and no ``mma.sync``, whose accumulation would not give the tile kernel's bits."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jetrl.quant.kernels import exact_attention_triton as E

    kernel = E._exact_decode_kernel
    types = {"q_ptr": "*bf16", "k_ptr": "*fp8e4nv" if fp8 else "*bf16", "v_ptr": "*fp8e4nv" if fp8 else "*bf16",
             "ks_ptr": "*fp32" if fp8 else "*bf16", "vs_ptr": "*fp32" if fp8 else "*bf16", "tables_ptr": "*i32",
             "qsl_ptr": "*i32", "ctx_ptr": "*i32", "tile_seq_ptr": "*i32", "tile_start_ptr": "*i32",
             "out_ptr": "*bf16", "scale_log2": "fp32"}
    consts = dict(GROUP=4, COLS=E.DECODE_MIN_COLS, HEAD_DIM=128, PAGE=16, BLOCK_D=128, BLOCK_N=64, IEEE=False,
                  FP8=fp8, WHILE_LOOP=False)
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    skip_without_sm90_compiler()
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=4, num_stages=2, **COMPILE_OPTIONS)).asm["ptx"]
    wgmma = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\.f32\.bf16\.bf16", ptx)
    # scores: K = 128 in 8 steps; row sum: K = 64 in 4; V^T @ P^T: 128 rows (two 64-row MMAs) x K = 64 in 4 steps
    assert Counter(wgmma) == Counter({"m64n16k16": 8 + 4 + 2 * 4}), Counter(wgmma)
    assert "mma.sync" not in ptx
