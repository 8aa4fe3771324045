"""Exact mode's TMA walk (``_exact_gemm_tma_kernel``) compiled for the H200 (sm_90a) on the CPU machine.

Row scales (``ROW_SCALE``, where a tile's columns lie in one 128-row weight scale block): ``sa * sb`` applied as a
per-row factor. Each factor is the same fp32 product ``sa[m] * sb`` the outer product ``sa[:, None] * sb[None, :]`` holds,
and ``acc += dot * s`` is the same contracted ``fma(dot, s, acc)`` per element, so the bits are the plain walk's
(checked on the GPU against the plain kernel and cuBLAS, ``tests/exact/test_exact_gpu.py``); what changes is the
work per K block, checked here: the outer product's BLOCK_M x BLOCK_N multiplies are gone, the fused multiply-adds
and the Hopper MMAs are the same.
"""

from __future__ import annotations

import re

import pytest

from jetrl.quant.kernels.tuning import COMPILE_OPTIONS
from sm90_compile import skip_without_sm90_compiler


def _ptx(row_scale: bool, block_m: int = 64, warps: int = 4, block_n: int = 128) -> str:
    skip_without_sm90_compiler()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jetrl.quant.kernels import gemm_exact_triton as G

    kernel = G._exact_gemm_tma_kernel
    names = kernel.arg_names
    # the 8B down projection: K = 14,336 (112 blocks) in 4 splits of 28, 64 x 128 tiles
    consts = dict(NUM_KB=112, SPLIT_KB=28, SPLITS=4, B_SCALE_ROWS=128, BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=8,
                  ROW_SCALE=row_scale)
    types = {"a_desc": f"tensordesc<fp8e4nv[{block_m}, 128]>", "b_desc": f"tensordesc<fp8e4nv[{block_n}, 128]>",
             "c_ptr": "*bf16", "as_ptr": "*fp32", "bs_ptr": "*fp32"}
    assert set(names) == set(consts) | set(types) | {"M", "N", "stride_cm", "stride_cn", "stride_asm", "stride_ask",
                                                     "stride_bsn", "stride_bsk"}, names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=3, **COMPILE_OPTIONS)).asm["ptx"]


def _ops(ptx: str, block_n: int) -> dict:
    return {"fma": len(re.findall(r"\bfma\.rn\.f32\b", ptx)), "mul": len(re.findall(r"\bmul\.(?:rn\.)?f32\b", ptx)),
            "wgmma": len(re.findall(rf"wgmma\.mma_async\.sync\.aligned\.m64n{block_n}k32\.f32\.e4m3\.e4m3", ptx))}


@pytest.mark.parametrize("block_m,warps,block_n", [(64, 4, 128), (128, 8, 128), (64, 4, 64)])
def test_row_scale_drops_the_outer_products_multiplies(block_m, warps, block_n):
    """Wide weights' 128-column tiles (one or two warpgroups) and narrow weights' 64-column ones."""
    plain = _ops(_ptx(False, block_m, warps, block_n), block_n)
    row = _ops(_ptx(True, block_m, warps, block_n), block_n)
    per_thread = 64 * block_n // 128  # a 64 x BLOCK_N accumulator per warpgroup of 128 threads
    # two copies of the K loop (the first split and the loop over the others), one FMA per accumulator element each
    assert plain["fma"] == row["fma"] == 2 * per_thread, (plain, row)
    assert plain["mul"] >= 2 * per_thread and row["mul"] <= 8, (plain, row)  # outer products gone: 2 rows' factors
    assert plain["wgmma"] == row["wgmma"] > 0, (plain, row)
