"""The exact attention kernels compiled for the H200 (sm_90a) on this CPU machine, no GPU needed: the per-thread
instruction mix that decides a row's bits is the one-tile kernel's, T times over in the multi-tile kernel (T tiles
in one 4-warp group) and once in the stacked one (one 4-warp group per tile): the same Hopper MMA instructions
(``wgmma ... m64n64k16`` for the scores, ``m64n128k16`` for ``P @ V``) and the same counts of fp32 multiplies,
adds, fmas, ``ex2``, divisions, maxima and bf16 roundings. A structural check of what the GPU test
(test_exact_tiles_gpu.py) checks bitwise; it would catch e.g. a different MMA shape or warp layout per tile."""

import importlib.util
import re
from collections import Counter

import pytest

from jetrl.quant.kernels.tuning import COMPILE_OPTIONS
from sm90_compile import skip_without_sm90_compiler

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton) ")

OPS = ("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16", "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16",
       "fma.rn.f32", "mul.f32", "add.f32", "sub.f32", "ex2.approx", "div.full.f32", "div.rn.f32", "max.f32",
       "cvt.rn.bf16x2.f32")


def _ptx_ops(tiles: int, stacked: bool) -> Counter:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jetrl.quant.kernels import exact_attention_triton as E

    kernel = E._exact_attention_tiles_kernel if tiles > 1 and not stacked else E._exact_attention_kernel
    types = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "ks_ptr": "*bf16", "vs_ptr": "*bf16",
             "tables_ptr": "*i32", "qsl_ptr": "*i32", "ctx_ptr": "*i32", "tile_seq_ptr": "*i32",
             "tile_start_ptr": "*i32", "out_ptr": "*bf16", "scale_log2": "fp32"}
    consts = dict(GROUP=4, GROUP_P2=4, HEAD_DIM=128, PAGE=1, BLOCK_Q=16 * (tiles if stacked else 1), BLOCK_D=128,
                  BLOCK_N=64, IEEE=False, FP8=False, WHILE_LOOP=False)
    if kernel is E._exact_attention_tiles_kernel:
        consts["TILES"] = tiles
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=4 * (tiles if stacked else 1), num_stages=2, **COMPILE_OPTIONS))
    ptx = compiled.asm["ptx"]
    return Counter({op: len(re.findall(re.escape(op) + r"\b", ptx)) for op in OPS})


@pytest.fixture(scope="module")
def one_tile():
    skip_without_sm90_compiler()
    return _ptx_ops(1, False)


def test_one_tile_kernel_runs_hopper_mma(one_tile):
    assert one_tile[OPS[0]] == 8 and one_tile[OPS[1]] == 4, one_tile  # K = 128 and 64 in steps of 16


@pytest.mark.parametrize("tiles,stacked", [(2, False), (3, False), (2, True)])
def test_schedules_have_the_one_tile_instruction_mix(one_tile, tiles, stacked):
    ops = _ptx_ops(tiles, stacked)
    want = Counter({op: n * (1 if stacked else tiles) for op, n in one_tile.items()})
    assert ops == want, (tiles, stacked, ops, want)


def _instructions(kernel, fp8: bool) -> list[str]:
    """The PTX instruction sequence of ``kernel`` compiled for sm_90a (bf16 queries; FP8 or bf16 cache), with
    register numbers and labels erased: two sources that compile to the same machine code give the same list."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {"q_ptr": "*bf16", "k_ptr": "*fp8e4nv" if fp8 else "*bf16", "v_ptr": "*fp8e4nv" if fp8 else "*bf16",
             "ks_ptr": "*fp32" if fp8 else "*bf16", "vs_ptr": "*fp32" if fp8 else "*bf16", "tables_ptr": "*i32",
             "qsl_ptr": "*i32", "ctx_ptr": "*i32", "tile_seq_ptr": "*i32", "tile_start_ptr": "*i32",
             "out_ptr": "*bf16", "scale_log2": "fp32"}
    consts = dict(GROUP=4, GROUP_P2=4, HEAD_DIM=128, PAGE=16 if fp8 else 1, BLOCK_Q=16, BLOCK_D=128, BLOCK_N=64,
                  IEEE=False, FP8=fp8, WHILE_LOOP=False)
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=4, num_stages=2, **COMPILE_OPTIONS)).asm["ptx"]
    out = []
    for line in ptx.splitlines():
        line = line.strip()
        if not line or line.startswith((".", "//", "}", "{")) or line.endswith(":"):
            continue
        out.append(re.sub(r"%[a-z]+\d+", "%", re.sub(r"\$L__\w+", "L", line)))
    return out


@pytest.mark.parametrize("fp8", [False, True])
def test_default_kernel_compiles_to_the_measured_kernels_instructions(one_tile, fp8):
    """The default schedule (one tile per program) was refactored into helpers shared with the multi-tile kernel;
    it must still be the kernel measured on the H200 (kept verbatim in tests/exact/one_tile_exact_attention.py):
    the same instructions in the same order, for a bf16 and an FP8 cache."""
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import one_tile_exact_attention as old

    from jetrl.quant.kernels import exact_attention_triton as E

    new = _instructions(E._exact_attention_kernel, fp8)
    assert new == _instructions(old._exact_attention_kernel, fp8)
    assert any(line.startswith("wgmma.mma_async") for line in new)  # the comparison saw the dots


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
