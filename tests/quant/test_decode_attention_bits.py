"""The decode kernel's E4M3 -> bf16 conversion by bit operations (its factored route's, ``_load_e4m3_bytes``).

* the conversion itself, bit for bit torch's ``.to`` for every E4M3 code but NaN (zeros of both signs, the
  subnormals, the largest values), into bf16 and fp32: under the interpreter (Triton's integer ops, the same bits as
  the PTX) and on the GPU (the PTX);
* ``paged_decode`` on the factored route under the interpreter: partial pages, a one-token context, GQA group 3,
  context splits, 16-token and default tiles, fp32 queries, within fp32 summation order of the reference (its bits
  against the kernel over the dequantized cache: ``test_kv_fp8_kernels.py``);
* compiled for the H200 (sm_90a) on this machine: no conversion instruction and no byte-wise shared-memory loads
  (Triton's own conversion has both), the MMAs of the BF16-cache kernel (a structural check of what makes it fast;
  the GPU sweep in ``bench/attention.py`` measures it);
* on the GPU at the 8B head shapes: within the tolerance of the reference.
"""

from __future__ import annotations

import importlib.util
import inspect
import re

import pytest

from jetrl.quant.kernels.tuning import COMPILE_OPTIONS
import torch

from interpreted import run_interpreted
from sm90_compile import skip_without_sm90_compiler
from test_kv_fp8_kernels import _SHARED, TOL, _decode_case, rel_err

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton) ")


def e4m3_codes(shift: int, device="cpu") -> torch.Tensor:
    """Every E4M3 value but NaN, as 64 rows of 4 (codes 0x7F and 0xFF, the NaNs, replaced by the zeros), rotated by
    ``shift``: shifts 0..3 put every value in each of the 4 bytes of a word."""
    codes = torch.arange(256, dtype=torch.int32)
    codes[0x7F], codes[0xFF] = 0x00, 0x80
    return codes.roll(shift).to(torch.uint8).view(torch.float8_e4m3fn).view(64, 4).to(device)


def _converted_bits(out: torch.Tensor, codes: torch.Tensor) -> bool:
    want = codes.to(out.dtype)
    view = torch.int16 if out.dtype == torch.bfloat16 else torch.int32
    return bool(torch.equal(out.view(view), want.view(view)))


_CHILD = r'''
import json, sys
import torch
from jetrl.models.attention import paged_attention_reference
from jetrl.quant import reference as R
from jetrl.quant.kernels import tuning
from jetrl.quant.kernels.paged_attention_triton import paged_decode
sys.path.insert(0, "tests/quant")
from e4m3_bits_kernel import convert_bytes
''' + "\n".join(inspect.getsource(f) for f in [*_SHARED, e4m3_codes, _converted_bits]) + r'''
out = {}
for dtype in (torch.bfloat16, torch.float32):
    out[f"convert-{str(dtype)[6:]}"] = [_converted_bits(convert_bytes(codes, dtype, False), codes)
                                        for codes in map(e4m3_codes, range(4))]

g = torch.Generator().manual_seed(0)
contexts, page, hq, hkv, d = [1, 37, 130], 8, 6, 2, 32  # a one-token context, partial pages, GQA group 3
meta, kd, ks, vd, vs = paged_case(g, contexts, [1] * len(contexts), page, hkv, d, shared_blocks=1)
q = torch.randn(len(contexts), hq, d, generator=g)  # fp32: the interpreter's bf16 dots are not IEEE
ref = paged_attention_reference(q, dequantize_kv_ref(kd, ks, q.dtype), dequantize_kv_ref(vd, vs, q.dtype), meta,
                                d ** -0.5)
for splits, block_n in ((1, 16), (3, 16), (2, None)):  # None: the default FP8 tile (128 tokens)
    with tuning.override(kv_decode_factored=True):
        got = paged_decode(q, kd, vd, meta, d ** -0.5, ks, vs, num_splits=splits, block_n=block_n)
    out[f"decode-splits{splits}-tile{block_n}"] = rel_err(got, ref)
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "decode attention: the bit conversion", timeout=600)


def test_conversion_is_torchs_for_every_e4m3_value(interpreted):
    assert interpreted["convert-bfloat16"] == interpreted["convert-float32"] == [True] * 4, interpreted


def test_paged_decode_on_the_factored_route_attends_like_the_reference(interpreted):
    cases = {name: err for name, err in interpreted.items() if name.startswith("decode-")}
    assert len(cases) == 3, sorted(cases)
    assert all(err < TOL["float32"] for err in cases.values()), cases


# ------------------------------------------------------------------------------------------------------------
# CPU: the kernel compiled for the H200 (sm_90a), no GPU needed


def _compile():
    """The decode kernel over an FP8 cache with bf16 queries, specialized as the runtime does at the 8B head shapes
    of ``bench/attention.py`` (pointers and ints divisible by 16 marked so, ints equal to 1 constants), compiled for
    sm_90a with the default launch (4 warps, 2 stages)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jetrl.quant.kernels import paged_attention_triton as P

    skip_without_sm90_compiler()

    kernel = P._paged_decode_kernel
    names = kernel.arg_names
    consts = dict(GROUP=4, HEAD_DIM=128, PAGE=16, NUM_SPLITS=1, BLOCK_G=16, BLOCK_D=128, BLOCK_N=128, IEEE=False,
                  FP8=True, FACTORED=True, SHARED_OFFSETS=True, WIDE_OFFSETS=False, HEAD_MAJOR=False,
                  WHILE_LOOP=False, stride_ksh=1, stride_vsh=1)
    ptrs = {"q_ptr": "*bf16", "k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "ks_ptr": "*fp32", "vs_ptr": "*fp32",
            "tables_ptr": "*i32", "ctx_ptr": "*i32", "out_ptr": "*bf16", "part_acc_ptr": "*fp32",
            "part_ml_ptr": "*fp32", "scale_log2": "fp32"}
    ints = dict(tokens_per_split=768, stride_qs=4096, stride_qh=128, stride_kb=16384, stride_kt=1024, stride_kh=128,
                stride_vb=16384, stride_vt=1024, stride_vh=128, stride_ksb=128, stride_kst=8, stride_vsb=128,
                stride_vst=8, stride_ts=48, stride_os=4096, stride_oh=128)
    assert set(names) == set(consts) | set(ptrs) | set(ints), set(names) ^ (set(consts) | set(ptrs) | set(ints))
    signature = {n: "constexpr" if n in consts else ptrs.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in names
             if n in ptrs and n != "scale_log2" or ints.get(n, 1) % 16 == 0}
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=4, num_stages=2, **COMPILE_OPTIONS))


OPS = {"e4m3 cvt": r"cvt\.rn\.f16x2\.e4m3x2", "f16->bf16 cvt": r"cvt\.(rn\.)?bf16\.f16", "byte ld.shared":
       r"ld\.shared(\.v\d)?\.[bu]8", "mma": r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32",
       "ldmatrix.trans": r"ldmatrix\.sync\.aligned\.m8n8\.x4\.trans", "bits prmt": r"prmt\.b32 [^;]*0x9180;",
       "bf16x2 fma": r"fma\.rn\.bf16x2"}


def test_bit_route_compiles_without_conversions_or_byte_loads():
    """Triton's own conversion goes through fp16 (``cvt.rn.f16x2.e4m3x2``, then one ``cvt.bf16.f16`` per value) in
    the dots' operand layout; the bit route has no conversion instruction and reads no shared memory a byte at a
    time, and brings V to its dot through a transposing ``ldmatrix`` of bf16, as the BF16-cache kernel does. Its
    conversion is a prmt, shl, and, fma per pair: K and V, 128 tokens x 128 values, 4 bytes a word, so per thread of
    128 64 words, 2 prmts of the 0x9180/0xB3A2 kind and 2 packed multiplies each."""
    counts = {name: len(re.findall(pattern, _compile().asm["ptx"])) for name, pattern in OPS.items()}
    assert counts["e4m3 cvt"] == counts["f16->bf16 cvt"] == counts["byte ld.shared"] == 0, counts
    # per warp of 4: (16 x 128 scores, 128 deep) + (16 x 128 outputs, 128 deep) in m16n8k16 steps, over 4 warps
    assert counts["mma"] == 2 * (128 // 8) * (128 // 16) // 4, counts
    assert counts["ldmatrix.trans"] > 0 and counts["bits prmt"] > 0 and counts["bf16x2 fma"] == 2 * counts["bits prmt"]


# ------------------------------------------------------------------------------------------------------------
# GPU: the PTX conversion, and the route at the Llama-3.1-8B head shapes


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_conversion_on_the_gpu_is_torchs_for_every_e4m3_value(dtype):
    from e4m3_bits_kernel import convert_bytes

    for shift in range(4):
        codes = e4m3_codes(shift, "cuda")
        assert _converted_bits(convert_bytes(codes, dtype, True), codes), shift


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs", [1, 5, 64])
def test_paged_decode_bit_route_at_8b_shapes(num_seqs):
    from jetrl.models.attention import paged_attention_reference
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.paged_attention_triton import paged_decode

    q, meta, kd, ks, vd, vs = _decode_case(num_seqs)
    kq, vq = kd.float() * ks[..., None], vd.float() * vs[..., None]
    ref = paged_attention_reference(q.float(), kq, vq, meta, q.shape[-1] ** -0.5)
    for kw in ({}, {"num_splits": 3}, {"block_n": 64}, {"block_n": 256}):
        with tuning.override(kv_decode_factored=True, kv_decode_streams=False):
            b = paged_decode(q, kd, vd, meta, q.shape[-1] ** -0.5, ks, vs, **kw)
        assert b.dtype == torch.bfloat16 and torch.isfinite(b).all(), kw
        assert rel_err(b, ref) < 1e-2, (kw, rel_err(b, ref))
