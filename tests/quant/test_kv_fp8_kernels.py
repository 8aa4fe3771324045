"""Issue 17's kernels over an FP8 KV cache: the two attention kernels reading E4M3 K/V with one power-of-two fp32
scale per (token, KV head), and the fused quantize-and-scatter write of new tokens' K/V.

The contract (``jetrl.models.attention.quantize_kv`` / ``dequantize_kv``) is restated here as two small helpers,
so that these tests hold the kernels to the formulas themselves:

* ``write_kv_copy`` (a cache of K/V's own dtype: BF16) == two ``index_copy_``, BITWISE, every slot;
* ``write_kv_fp8`` == quantize (``scale = compute_scale(amax over head_dim, pow2_scale=True)``, ``data =
  e4m3(clamp(x / scale))``) then scatter to the slots, BITWISE (data bytes and scales; slots not written keep
  their bytes); at head_dim 128 that is the linears' 1x128 quantization with power-of-two scales;
* ``exact_attention_fwd(fp8 cache + scales) == exact_attention_fwd(dequantized cache)`` BITWISE (it dequantizes a
  chunk in registers with the same formula, then runs the unchanged math), and close to the reference;
* ``paged_decode`` over an FP8 cache feeds the E4M3 tiles to its dots and applies the scales to their fp32 results
  (bf16 and fp32 queries): equal to the kernel over the dequantized cache to summation order. In fp32 under the
  interpreter, with one dot implementation and one tile size for both, that is bit for bit (multiplying by a power
  of two commutes with every rounding; outputs below 2^-126 excepted), and both are within fp32 summation order
  (1e-6) of the reference; with scales that are not powers of two it is not bit for bit, which tells the factored
  kernel from one dequantizing in registers. An fp16 query dequantizes in registers: bitwise.

On CPU the kernels run under the Triton interpreter in a child process (``tests/interpreted.py``) at small
shapes, with fp32, fp16 and bf16 queries. The interpreter's bf16 arithmetic is not IEEE (a bf16 product or
``tl.dot`` of bf16 operands gives garbage, see ``tests/models/test_paged_decode_interpret.py``; conversions are
right): exact mode's kernel is checked there in bf16 for the bitwise identity only (a deterministic function of the
same operand bits, which still needs the in-register dequantization to round to bf16 exactly like torch), and the
decode kernel's bf16 path, whose dots see other operands by design, not at all. Both are left to the GPU tests
(``gpu`` marker) at the Llama-3.1-8B head shapes: 32 query heads, 8 KV heads, head_dim 128, bf16, pages of 16,
batches of 1 to 64, partial pages, shared prefix blocks, one-token contexts and contexts long enough for the decode
kernel's context split, plus a GQA group of 6 with fp32 and bf16 queries.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from interpreted import run_interpreted
from jetrl.quant import reference as R

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton) ")


# ------------------------------------------------------------------------------------------------------------
# the contract's formulas and a paged-cache builder (shared with the interpreter child through their source)


def quantize_kv_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> E4M3 data (..., D) and power-of-two fp32 scales (...): one scale per row of head_dim values."""
    scale = R.compute_scale(x.abs().amax(-1), pow2_scale=True)
    return (x.float() / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def dequantize_kv_ref(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (data.float() * scale[..., None]).to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same dtype, shape and bits (floats compared as integers of their width: -0.0 is not +0.0, a NaN equals
    only its own bits)."""
    ints = {torch.float8_e4m3fn: torch.uint8, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float32: torch.int32}
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in ints:
        a, b = a.contiguous().view(ints[a.dtype]), b.contiguous().view(ints[b.dtype])
    return bool(torch.equal(a, b))


def same_bits_but_subnormal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` (fp32) the same bits wherever either is a normal number (>= 2^-126 in magnitude), less than
    2^-126 apart elsewhere: the factored decode's one documented exception (terms below 2^-126 may round apart)."""
    normal = torch.maximum(a.abs(), b.abs()) >= 2.0 ** -126
    return a.shape == b.shape and bool(torch.equal(a[normal], b[normal])) and bool(
        ((a - b).abs()[~normal] < 2.0 ** -126).all())


def kv_values(gen, shape, device="cpu") -> torch.Tensor:
    """fp32 K/V-like values (..., D): channels of magnitudes 1e-3 .. 10 (E4M3 subnormals in the small ones), an
    all-zero token, a zero head and an outlier."""
    head_dim = shape[-1]
    x = torch.randn(shape, generator=gen, device=device) * torch.logspace(-3, 1, head_dim, device=device)
    flat = x.view(-1, shape[-2], head_dim)
    flat[0] = 0.0  # a whole token (every KV head) zero: scale 1e-4 / 448, data 0
    flat[min(1, flat.shape[0] - 1), -1] = 0.0
    flat[min(2, flat.shape[0] - 1), 0, head_dim // 2] = -300.0
    return x


def paged_case(gen, contexts, q_lens, page, num_kv_heads, head_dim, device="cpu", shared_blocks=0):
    """Metadata and an FP8 K/V pool for sequences holding ``contexts`` tokens, the last ``q_lens`` of them new.

    Blocks are scattered (a random permutation of the pool); the first ``shared_blocks`` blocks of every sequence
    are sequence 0's (prefix sharing); tables have one spare -1 column. Returns ``(meta, kd, ks, vd, vs)``.
    """
    from jetrl.models.attention import PagedAttentionMetadata

    num_seqs = len(contexts)
    pages = [-(-c // page) for c in contexts]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=gen, device=device).tolist()
    tables = torch.full((num_seqs, max(pages) + 1), -1, dtype=torch.int32)
    for s, n in enumerate(pages):
        own = min(shared_blocks, n, pages[0]) if s else 0
        tables[s, :own] = tables[0, :own]
        tables[s, own:n] = torch.tensor(perm[:n - own], dtype=torch.int32)
        perm = perm[n - own:]
    kd, ks = quantize_kv_ref(kv_values(gen, (num_blocks, page, num_kv_heads, head_dim), device))
    vd, vs = quantize_kv_ref(kv_values(gen, (num_blocks, page, num_kv_heads, head_dim), device) * 0.5)
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    meta = PagedAttentionMetadata(
        query_start_loc=qsl.to(device), context_lens=torch.tensor(contexts, dtype=torch.int32, device=device),
        block_tables=tables.to(device), slot_mapping=torch.zeros(int(qsl[-1]), dtype=torch.long, device=device),
        max_query_len=max(q_lens), max_context_len=max(contexts))
    return meta, kd, ks, vd, vs


def write_case(gen, num_tokens, num_kv_heads, head_dim, dtype, num_blocks, page, device="cpu"):
    """New K/V rows (a strided view, as sliced from a fused projection) with zero rows and huge and tiny values,
    pools prefilled with a pattern, and scattered slots (int64). Returns ``(k, v, pools, slots)``."""
    big = {torch.float16: 6e4, torch.bfloat16: 1e30, torch.float32: 1e30}[dtype]
    wide = kv_values(gen, (num_tokens, num_kv_heads + 2, head_dim), device)
    wide[-1, 1, :3] = torch.tensor([big, -big, 1.0])  # saturation next to ordinary values (a kept head)
    k = wide.to(dtype)[:, 1:num_kv_heads + 1]  # stride(0) != Hkv * D
    v = (kv_values(gen, (num_tokens, num_kv_heads, head_dim), device) * 1e-3).to(dtype)
    if num_tokens > 3:
        v[3] = -0.0  # negative zeros stay negative zeros
        if dtype == torch.float32:
            v[2, 0, :5] = 1e-30  # below the 1e-4 amax floor: scale 1e-4 / 448, data 0
    shape = (num_blocks, page, num_kv_heads, head_dim)
    pattern = torch.arange(torch.Size(shape).numel(), device=device).remainder(200).to(torch.uint8)
    pools = (pattern.view(shape).view(torch.float8_e4m3fn), pattern.view(shape).clone().view(torch.float8_e4m3fn),
             torch.full(shape[:3], -1.0, device=device), torch.full(shape[:3], -2.0, device=device))
    slots = torch.randperm(num_blocks * page, generator=gen, device=device)[:num_tokens]
    return k, v, pools, slots


def check_write(k, v, pools, slots) -> dict:
    """Run write_kv_fp8; compare with the formula: the written slots bitwise, every other slot unchanged."""
    from jetrl.quant.kernels.kv_cache_triton import write_kv_fp8

    kc, vc, ks, vs = pools
    before = [t.clone() for t in pools]
    write_kv_fp8(k, v, kc, vc, ks, vs, slots)
    rk, rks = quantize_kv_ref(k)
    rv, rvs = quantize_kv_ref(v)
    rk, rv = rk.view(torch.uint8), rv.view(torch.uint8)
    kept = torch.ones(kc.shape[0] * kc.shape[1], dtype=torch.bool, device=k.device)
    kept[slots.long()] = False
    slots = slots.long()
    # bytes, not E4M3 values: compared (and indexed) as uint8
    flat = [(t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).flatten(0, 1)
            for t in (kc, vc, ks, vs, *before)]
    return {
        "k_data": same_bits(flat[0][slots], rk), "v_data": same_bits(flat[1][slots], rv),
        "k_scale": same_bits(flat[2][slots], rks), "v_scale": same_bits(flat[3][slots], rvs),
        "others_kept": all(same_bits(flat[i][kept], flat[i + 4][kept]) for i in range(4)),
    }


def check_copy(k, v, num_blocks, page, slots) -> dict:
    """Run write_kv_copy into pools of k's dtype prefilled with a pattern; compare with two ``index_copy_``: every
    slot bitwise (the written ones hold K/V, the others their pattern)."""
    from jetrl.quant.kernels.kv_cache_triton import write_kv_copy

    shape = (num_blocks, page, k.shape[1], k.shape[2])
    pattern = torch.arange(torch.Size(shape).numel(), device=k.device).remainder(97).to(k.dtype).view(shape) - 48
    kc, vc = pattern.clone(), -pattern
    rk, rv = kc.clone().flatten(0, 1), vc.clone().flatten(0, 1)
    rk.index_copy_(0, slots.long(), k)
    rv.index_copy_(0, slots.long(), v)
    write_kv_copy(k, v, kc, vc, slots)
    return {"k": same_bits(kc.flatten(0, 1), rk), "v": same_bits(vc.flatten(0, 1), rv)}


def attend(kernel, q, meta, kd, ks, vd, vs, **kw):
    """``kernel`` over the FP8 cache and over its dequantized copy (q's dtype): ``(fp8_out, dequantized_out, kq,
    vq)``."""
    kq, vq = dequantize_kv_ref(kd, ks, q.dtype), dequantize_kv_ref(vd, vs, q.dtype)
    scale = q.shape[-1] ** -0.5
    return kernel(q, kd, vd, meta, scale, ks, vs, **kw), kernel(q, kq, vq, meta, scale, **kw), kq, vq


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm())


_SHARED = [quantize_kv_ref, dequantize_kv_ref, same_bits, same_bits_but_subnormal, kv_values, paged_case, write_case,
           check_write, check_copy, attend, rel_err]


# ------------------------------------------------------------------------------------------------------------
# CPU: the kernels under the Triton interpreter, in a child


_CHILD = r'''
import json, sys
import torch
from jetrl.quant import ACT
from jetrl.quant import reference as R
from jetrl.quant.kernels.exact_attention_triton import exact_attention_fwd
from jetrl.quant.kernels.paged_attention_triton import paged_decode
from jetrl.models.attention import exact_attention_reference, packed_as_paged, paged_attention_reference
''' + "\n".join(inspect.getsource(f) for f in _SHARED) + r'''
out = {}
g = torch.Generator().manual_seed(0)

# the write: bf16 / fp16 / fp32 rows, head_dim 128 (the 1x128 activation format) and 40 (not a power of two)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for n, hkv, d in ((9, 3, 40), (6, 2, 128)):
        k, v, pools, slots = write_case(g, n, hkv, d, dtype, num_blocks=5, page=4)
        out[f"write-{n}x{hkv}x{d}-{str(dtype)[6:]}"] = check_write(k, v, pools, slots)
        if d == 128:  # the helper is the 1x128 quantization of the linears (power-of-two scales) at head_dim 128
            data, scale = R.quantize(k.reshape(-1, 128), ACT, pow2_scale=True)
            rk, rks = quantize_kv_ref(k)
            out[f"write-{n}x{hkv}x{d}-{str(dtype)[6:]}"]["is_1x128"] = (
                same_bits(rk.reshape(-1, 128), data) and same_bits(rks.reshape(-1, 1), scale))
k, v, pools, slots = write_case(g, 7, 2, 32, torch.bfloat16, num_blocks=4, page=4)
out["write-int32-slots"] = check_write(k, v, pools, slots.to(torch.int32))
# the copy into a cache of K/V's own dtype (the BF16 cache): the same strided rows, negative zeros, int32 slots
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for n, hkv, d in ((9, 3, 40), (6, 2, 128)):
        k, v, _, slots = write_case(g, n, hkv, d, dtype, num_blocks=5, page=4)
        out[f"copy-{n}x{hkv}x{d}-{str(dtype)[6:]}"] = check_copy(k, v, 5, 4, slots)
k, v, _, slots = write_case(g, 7, 2, 32, torch.bfloat16, num_blocks=4, page=4)
out["copy-int32-slots"] = check_copy(k, v, 4, 4, slots.to(torch.int32))
# the seam: write_kv on a BF16 cache with the kernels forced is the reference's two index_copy_; K/V of another
# dtype than the pools stay on the reference inside a block forcing the kernels (the cast)
from jetrl.models.attention import write_kv
from jetrl.quant.backend import fused_impl
k, v, _, slots = write_case(g, 9, 3, 40, torch.bfloat16, num_blocks=5, page=4)
pools = [torch.randn(5, 4, 3, 40, generator=g).to(torch.bfloat16) for _ in range(2)]
ref = [t.clone() for t in pools]
write_kv(*ref, k, v, slots, impl="reference")
write_kv(*pools, k, v, slots, impl="triton")
out["seam-copy-forced"] = {"k": same_bits(pools[0], ref[0]), "v": same_bits(pools[1], ref[1])}
write_kv(*ref, k.float(), v.float(), slots, impl="reference")
with fused_impl("triton"):
    write_kv(*pools, k.float(), v.float(), slots)
out["seam-cast-in-forced-block"] = {"k": same_bits(pools[0], ref[0]), "v": same_bits(pools[1], ref[1])}

# decode: partial and whole pages, a context of 1, shared prefix blocks, split contexts (3 splits); GQA group 2 and
# MQA (group 6, not a power of two); 16-token tiles and the default FP8 tile (128 tokens, contexts up to 300).
# fp32 queries take the factored path (E4M3 tiles into the dots, scales on the fp32 sides): recorded are the bits
# against the same kernel over the dequantized cache at the same tile size (except in outputs below 2^-126: a head
# whose values nearly vanish where one key dominates, as the zero token and the -300 outlier make happen), and the
# relative errors against the reference. fp16 queries dequantize in registers (bits; error ~3e-4: P is rounded to
# fp16 for P @ V). bf16 queries are exact mode's only (the interpreter's bf16 dots are not IEEE, see the module doc).
# Each context runs the (splits, tokens per tile) pairs listed with it, and the default tile with one split: one split
# of 16-token tiles (several tiles per program); 3 splits of 16 at head_dim 48 (the merge over a padded BLOCK_D, an
# empty split); 3 splits of 128 at contexts up to 300 (the merge of full FP8 tiles, empty splits for the short
# sequences). Every path of the kernel, without the cross product that the interpreter makes slow.
# The factored route is the tuning's kv_decode_factored (the default; made explicit here): on for these.
from jetrl.quant.kernels import tuning
factored = tuning.override(kv_decode_factored=True)
factored.__enter__()
decode_cases = [((1, 9, 37), 4, 4, 2, 32, ((1, 16),)), ((23, 40), 8, 6, 1, 48, ((3, 16),)),
                ((1, 130, 300), 16, 6, 1, 32, ((1, 16), (3, 128)))]
for ctx, page, hq, hkv, d, runs in decode_cases:
    meta, kd, ks, vd, vs = paged_case(g, list(ctx), [1] * len(ctx), page, hkv, d, shared_blocks=1)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        q = torch.randn(len(ctx), hq, d, generator=g).to(dtype)
        kq, vq = dequantize_kv_ref(kd, ks, dtype), dequantize_kv_ref(vd, vs, dtype)
        if dtype != torch.bfloat16:
            ref = paged_attention_reference(q.float(), kq.float(), vq.float(), meta, d ** -0.5)
            for splits, block_n in runs:
                a, b, _, _ = attend(paged_decode, q, meta, kd, ks, vd, vs, num_splits=splits, block_n=block_n)
                bitwise = same_bits(a, b) if dtype == torch.float16 else same_bits_but_subnormal(a, b)
                out[f"decode-{ctx}-{str(dtype)[6:]}-splits{splits}-tile{block_n}"] = {
                    "bitwise": bitwise, "err": rel_err(a, ref), "err_dequantized": rel_err(b, ref)}
            a = paged_decode(q, kd, vd, meta, d ** -0.5, ks, vs, num_splits=1)  # the default tile
            out[f"decode-{ctx}-{str(dtype)[6:]}-splits1-default"] = {"err": rel_err(a, ref)}
        a, b, kq, vq = attend(exact_attention_fwd, q, meta, kd, ks, vd, vs)
        r = {"bitwise": same_bits(a, b)}
        if dtype != torch.bfloat16:
            r["err"] = rel_err(a, exact_attention_reference(q, kq, vq, meta, d ** -0.5))
        out[f"exact-decode-{ctx}-{str(dtype)[6:]}"] = r

# a peaked softmax (queries x 40): most probabilities fall below 2^-104 or to 0, where p * v_scale may fall below
# 2^-126 and round; the factored fp32 path stays within fp32 summation order of the reference
meta, kd, ks, vd, vs = paged_case(g, [1, 60, 200], [1, 1, 1], 16, 1, 32)
q = torch.randn(3, 6, 32, generator=g) * 40
kq, vq = dequantize_kv_ref(kd, ks, torch.float32), dequantize_kv_ref(vd, vs, torch.float32)
ref = paged_attention_reference(q, kq, vq, meta, 32 ** -0.5)
out["peaked-decode-float32"] = {"err": rel_err(paged_decode(q, kd, vd, meta, 32 ** -0.5, ks, vs, num_splits=2), ref)}

# the factored path itself: with scales that are not powers of two (outside the contract) the fp32 kernel over the
# FP8 cache is no longer bit for bit the kernel over the dequantized cache (whose products k8 * s round; the FP8
# kernel never forms them, as a kernel dequantizing in registers would), yet the same attention to summation order
meta, kd, ks, vd, vs = paged_case(g, [5, 40, 77], [1, 1, 1], 8, 2, 32)
q = torch.randn(3, 4, 32, generator=g)
ks, vs = ks * 1.1, vs * 0.9
a, b, kq, vq = attend(paged_decode, q, meta, kd, ks, vd, vs, block_n=16)
ref = paged_attention_reference(q, kq, vq, meta, 32 ** -0.5)
out["nonpow2-decode-float32"] = {"bitwise": same_bits(a, b), "err": rel_err(a, ref)}
factored.__exit__(None, None, None)
# the other route (kv_decode_factored off) dequantizes each FP8 tile in registers: bit for bit the kernel over the
# dequantized cache
with tuning.override(kv_decode_factored=False):
    a, b, kq, vq = attend(paged_decode, q, meta, kd, ks, vd, vs, block_n=16)
out["inregister-decode-float32"] = {"bitwise": same_bits(a, b), "err": rel_err(a, ref)}

# exact mode's prefill chunks (several new rows per sequence, partial pages) and its packed training layout
# (one-token pages: K (N, Hkv, D) viewed as (N, 1, Hkv, D), scales (N, 1, Hkv))
meta, kd, ks, vd, vs = paged_case(g, [5, 21, 70], [5, 3, 10], 8, 2, 32, shared_blocks=1)
cu = [0, 1, 8, 78]  # packed sequences of 1, 7 and 70 tokens
pk, pks = quantize_kv_ref(kv_values(g, (78, 2, 32)))
pv, pvs = quantize_kv_ref(kv_values(g, (78, 2, 32)))
packed = packed_as_paged(cu, "cpu")
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for name, m, args, rows in (("prefill", meta, (kd, ks, vd, vs), 18),
                                ("packed", packed, (pk[:, None], pks[:, None], pv[:, None], pvs[:, None]), 78)):
        q = torch.randn(rows, 4, 32, generator=g).to(dtype)
        a, b, kq, vq = attend(exact_attention_fwd, q, m, *args)
        r = {"bitwise": same_bits(a, b)}
        if dtype != torch.bfloat16:
            r["err"] = rel_err(a, exact_attention_reference(q, kq, vq, m, 32 ** -0.5))
        out[f"exact-{name}-{str(dtype)[6:]}"] = r
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "FP8 KV-cache kernels", timeout=900)


def _cases(results: dict, prefix: str) -> dict:
    return {name: r for name, r in results.items() if name.startswith(prefix)}


def test_write_kv_fp8_is_the_formula_bitwise(interpreted):
    cases = _cases(interpreted, "write-")
    assert len(cases) == 7, sorted(cases)
    for name, r in cases.items():
        assert r.pop("is_1x128", True), name
        assert set(r) == {"k_data", "v_data", "k_scale", "v_scale", "others_kept"} and all(r.values()), (name, r)


def test_write_kv_copy_is_index_copy_bitwise(interpreted):
    cases = _cases(interpreted, "copy-")
    assert len(cases) == 7, sorted(cases)
    for name, r in cases.items():
        assert r == {"k": True, "v": True}, (name, r)
    seam = _cases(interpreted, "seam-")
    assert sorted(seam) == ["seam-cast-in-forced-block", "seam-copy-forced"], sorted(seam)
    assert all(r == {"k": True, "v": True} for r in seam.values()), seam


def test_same_bits_tells_signed_zeros_apart():
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert not same_bits(torch.tensor([0.0, 1.0], dtype=dtype), torch.tensor([-0.0, 1.0], dtype=dtype))
        assert same_bits(torch.tensor([-0.0, 1.0], dtype=dtype), torch.tensor([-0.0, 1.0], dtype=dtype))


def test_write_kv_forced_copy_rejects_what_its_kernel_cannot_take():
    from jetrl.models.attention import write_kv

    gen = torch.Generator().manual_seed(1)
    k, v, _, slots = write_case(gen, 5, 2, 16, torch.bfloat16, num_blocks=3, page=4)
    pools = [torch.zeros(3, 4, 2, 16, dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(TypeError, match="the one-launch copy takes K, V and pools of one dtype"):
        write_kv(*pools, k.float(), v.float(), slots, impl="triton")
    with pytest.raises(TypeError, match="contiguous slots"):
        write_kv(*pools, k, v, torch.arange(10)[::2], impl="triton")


# tolerances (relative error norms) against the references over the same dequantized values: fp32 to summation
# order; fp16 rounds the probabilities to fp16 for P @ V (~3e-4)
TOL = {"float32": 1e-6, "float16": 2e-3}


def test_paged_decode_over_fp8_tiles_is_the_attention_over_the_dequantized_cache(interpreted):
    cases = _cases(interpreted, "decode-")
    assert len(cases) == (1 + 1 + 2 + 3) * 2, sorted(cases)  # (the listed runs, a default per context) x dtypes
    for name, r in cases.items():
        tol = TOL[name.split("-")[2]]
        assert r["err"] < tol and r.get("err_dequantized", 0.0) < tol, (name, r)
        # bit for bit the BF16-cache kernel over the dequantized cache at the same tile size: fp16 dequantizes in
        # registers; fp32 applies power-of-two scales to the dots' fp32 sides, which commutes with each rounding
        # (outputs below 2^-126 excepted: there a scaled term may round apart)
        assert r.get("bitwise", True), (name, r)
    assert interpreted["peaked-decode-float32"]["err"] < TOL["float32"], interpreted["peaked-decode-float32"]


def test_paged_decode_applies_the_scales_outside_the_dots(interpreted):
    """Non-power-of-two scales tell the factored kernel from one that dequantizes in registers (which would be
    bitwise the kernel over the dequantized cache); the other route (``kv_decode_factored`` off) is that one."""
    r = interpreted["nonpow2-decode-float32"]
    assert not r["bitwise"] and r["err"] < TOL["float32"], r
    r = interpreted["inregister-decode-float32"]
    assert r["bitwise"] and r["err"] < TOL["float32"], r


@pytest.mark.parametrize("kernel", ["exact-decode-", "exact-prefill-", "exact-packed-"])
def test_exact_attention_over_fp8_cache_attends_like_its_dequantized_copy(interpreted, kernel):
    cases = _cases(interpreted, kernel)
    assert len(cases) == {"exact-decode-": 9}.get(kernel, 3), sorted(cases)
    assert all(r["bitwise"] for r in cases.values()), cases
    errs = {name: r["err"] for name, r in cases.items() if "err" in r}
    assert len(errs) == 2 * len(cases) // 3, cases
    assert all(err < TOL[name.split("-")[-1]] for name, err in errs.items()), errs


# ------------------------------------------------------------------------------------------------------------
# CPU: input checks (host logic before any launch)


def _kernels():
    from jetrl.quant.kernels.exact_attention_triton import exact_attention_fwd
    from jetrl.quant.kernels.paged_attention_triton import paged_decode

    return {"paged_decode": paged_decode, "exact_attention": exact_attention_fwd}


@pytest.mark.parametrize("name", ["paged_decode", "exact_attention"])
def test_attention_kernels_reject_bad_fp8_inputs(name):
    fn = _kernels()[name]
    gen = torch.Generator().manual_seed(0)
    meta, kd, ks, vd, vs = paged_case(gen, [5, 9], [1, 1], 4, 2, 16)
    q = torch.randn(2, 4, 16, dtype=torch.bfloat16)
    kq, vq = dequantize_kv_ref(kd, ks, q.dtype), dequantize_kv_ref(vd, vs, q.dtype)
    with pytest.raises(ValueError, match=f"{name}: the cache is torch.float8_e4m3fn but no k_scale/v_scale"):
        fn(q, kd, vd, meta, 0.25)
    with pytest.raises(ValueError, match=f"{name}: k_scale/v_scale given but the cache is torch.bfloat16"):
        fn(q, kq, vq, meta, 0.25, ks, vs)
    with pytest.raises(ValueError, match=f"{name}: give both k_scale and v_scale"):
        fn(q, kd, vd, meta, 0.25, ks, None)
    with pytest.raises(ValueError, match=f"{name}: v_scale must be float32 of shape"):
        fn(q, kd, vd, meta, 0.25, ks, vs.to(torch.bfloat16))
    with pytest.raises(ValueError, match=f"{name}: k_scale must be float32 of shape"):
        fn(q, kd, vd, meta, 0.25, ks[:, :2], vs)
    with pytest.raises(ValueError, match=f"{name}: K and V caches differ"):
        fn(q, kd, vq, meta, 0.25, ks, vs)


def test_write_kv_fp8_rejects_bad_inputs():
    from jetrl.quant.kernels.kv_cache_triton import write_kv_fp8

    gen = torch.Generator().manual_seed(0)
    k, v, (kc, vc, ks, vs), slots = write_case(gen, 5, 2, 16, torch.bfloat16, num_blocks=3, page=4)
    with pytest.raises(ValueError, match="the caches must be torch.float8_e4m3fn"):
        write_kv_fp8(k, v, kc.float(), vc.float(), ks, vs, slots)
    with pytest.raises(ValueError, match="v_scale must be float32 of shape"):
        write_kv_fp8(k, v, kc, vc, ks, vs[:, :, :1], slots)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous int32/int64 of shape"):
        write_kv_fp8(k, v, kc, vc, ks, vs, slots[:4])
    with pytest.raises(ValueError, match="does not match the cache"):
        write_kv_fp8(k[:, :1], v[:, :1], kc, vc, ks, vs, slots)
    with pytest.raises(ValueError, match="k and v must be bfloat16/float16/float32"):
        write_kv_fp8(k.double(), v.double(), kc, vc, ks, vs, slots)
    with pytest.raises(ValueError, match="k and v must be \\(N, Hkv, D\\) of one shape"):
        write_kv_fp8(k, v[:4], kc, vc, ks, vs, slots)


def test_write_kv_copy_rejects_bad_inputs():
    from jetrl.quant.kernels.kv_cache_triton import write_kv_copy

    gen = torch.Generator().manual_seed(0)
    k, v, _, slots = write_case(gen, 5, 2, 16, torch.bfloat16, num_blocks=3, page=4)
    kc, vc = torch.zeros(3, 4, 2, 16, dtype=torch.bfloat16), torch.zeros(3, 4, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="k, v and the caches must have one dtype"):
        write_kv_copy(k.float(), v.float(), kc, vc, slots)
    with pytest.raises(ValueError, match="slot_mapping must be contiguous int32/int64 of shape"):
        write_kv_copy(k, v, kc, vc, slots[:4])
    with pytest.raises(ValueError, match="slot_mapping must be contiguous"):
        write_kv_copy(k, v, kc, vc, torch.arange(10)[::2])
    with pytest.raises(ValueError, match="does not match the cache"):
        write_kv_copy(k[:, :1], v[:, :1], kc, vc, slots)
    with pytest.raises(ValueError, match="k and v must be \\(N, Hkv, D\\) of one shape"):
        write_kv_copy(k, v[:4], kc, vc, slots)


# ------------------------------------------------------------------------------------------------------------
# GPU: the Llama-3.1-8B head shapes (32 query heads, 8 KV heads, head_dim 128, bf16, pages of 16)

HQ, HKV, D, PAGE = 32, 8, 128, 16


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("write", ["fp8", "copy"])
def test_write_kv_bitwise_at_8b_shape(write, num_tokens, dtype):
    """The FP8 write against its formula, the copy against index_copy_: bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    num_blocks = num_tokens // PAGE + 3
    k, v, pools, slots = write_case(gen, num_tokens, HKV, D, dtype, num_blocks=num_blocks, page=PAGE, device="cuda")
    r = check_write(k, v, pools, slots) if write == "fp8" else check_copy(k, v, num_blocks, PAGE, slots)
    assert r and all(r.values()), r


@pytest.mark.gpu
def test_write_kv_takes_the_one_launch_copy_on_the_gpu():
    """The seam: a BF16 cache on the GPU is written by the one-launch copy (equal to the reference's two
    index_copy_); K/V of another dtype than the pools go through the reference's cast."""
    from jetrl.models.attention import write_kv
    from jetrl.quant.backend import fused_impl

    gen = torch.Generator(device="cuda").manual_seed(3)
    k, v, _, slots = write_case(gen, 37, HKV, D, torch.bfloat16, num_blocks=6, page=PAGE, device="cuda")
    pools = [torch.randn(6, PAGE, HKV, D, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2)]
    ref = [t.clone() for t in pools]
    with fused_impl("reference"):
        write_kv(*ref, k, v, slots)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        write_kv(*pools, k, v, slots)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("_write_kv_kernel" in n for n in names) and not any("index_copy" in n for n in names), names
    assert all(same_bits(a, b) for a, b in zip(pools, ref))
    cast = [t.clone() for t in ref]
    with fused_impl("reference"):
        write_kv(*ref, k.float(), v.float(), slots)
    write_kv(*cast, k.float(), v.float(), slots)
    assert all(same_bits(a, b) for a, b in zip(cast, ref))


# batch sizes and their contexts: 1 and 5 sequences split their long contexts across programs (flash-decoding),
# 64 sequences fill the GPU without splitting; contexts are random (partial last pages), one is a single token
DECODE_BATCHES = {1: (8000, 8000), 5: (1, 3000), 64: (1, 1500)}


def _decode_case(num_seqs: int, q_lens=None):
    gen = torch.Generator(device="cuda").manual_seed(num_seqs)
    low, high = DECODE_BATCHES[num_seqs]
    contexts = torch.randint(low, high + 1, (num_seqs,), generator=gen, device="cuda").tolist()
    contexts[-1] = low
    q_lens = q_lens or [1] * num_seqs
    contexts = [max(c, n) for c, n in zip(contexts, q_lens)]  # a sequence holds at least its new tokens
    meta, kd, ks, vd, vs = paged_case(gen, contexts, q_lens, PAGE, HKV, D, "cuda", shared_blocks=2)
    q = torch.randn(sum(q_lens), HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    return q, meta, kd, ks, vd, vs


# Tolerance against the references on the dequantized cache: the kernels round the probabilities to bf16 for
# P @ V and the output to bf16 (each ~2^-9 relative), ~3e-3 relative overall, as for the BF16 cache in
# tests/rollout/test_rollout_gpu.py; a wrong scale, token or head misses by O(1).


@pytest.mark.gpu
@pytest.mark.parametrize("factored", [False, True])
@pytest.mark.parametrize("num_seqs", sorted(DECODE_BATCHES))
def test_paged_decode_fp8_at_8b_shapes(num_seqs, factored):
    """Both routes of the Triton decode kernel over an FP8 cache (``kv_decode_factored``) at the 8B head shapes (the
    Gluon kernel, the default where it applies, is tests/quant/test_decode_attention_streams.py's)."""
    from jetrl.quant.kernels import tuning

    with tuning.override(kv_decode_factored=factored, kv_decode_streams=False):
        _paged_decode_fp8_at_8b_shapes(num_seqs)


def _paged_decode_fp8_at_8b_shapes(num_seqs):
    from jetrl.models.attention import paged_attention_reference
    from jetrl.quant.kernels.paged_attention_triton import FP8_BLOCK_N, choose_num_splits, paged_decode


    q, meta, kd, ks, vd, vs = _decode_case(num_seqs)
    splits = choose_num_splits(num_seqs, HKV, meta.max_context_len, q.device, FP8_BLOCK_N)
    assert (splits > 1) == (num_seqs < 64), splits  # the cases cover both the split and the unsplit kernel
    kq, vq = dequantize_kv_ref(kd, ks, q.dtype), dequantize_kv_ref(vd, vs, q.dtype)
    ref = paged_attention_reference(q.float(), kq.float(), vq.float(), meta, D ** -0.5)
    # The FP8 kernel feeds the E4M3 tiles to its dots and scales their fp32 results: the attention over the
    # dequantized cache to summation order, checked against the reference and against the BF16-cache kernel over
    # the dequantized cache. Not bit for bit the latter on the GPU (the score dots' operands differ by a power of
    # two per key, and nothing promises that the MMA's accumulation commutes with that); exact mode's kernel is
    # the one whose bits are pinned (test_exact_attention_fp8_* below). Default tiles (128 FP8 tokens against 64
    # BF16 ones), a forced split, and both at one tile size.
    for kw in ({}, {"num_splits": 3}, {"block_n": 64}):
        a, b, _, _ = attend(paged_decode, q, meta, kd, ks, vd, vs, **kw)
        assert a.dtype == torch.bfloat16 and torch.isfinite(a).all(), kw
        assert rel_err(a, ref) < 1e-2 and rel_err(b, ref) < 1e-2 and rel_err(a, b) < 1e-2, kw


@pytest.mark.gpu
@pytest.mark.parametrize("factored", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_decode_fp8_group_of_6_long_split_contexts(dtype, factored):
    """GQA group 6 (12 query heads on 2 KV heads, padded to 16 MMA rows) at head_dim 128: contexts of one token,
    partial pages and up to 6000 tokens split across programs, bf16 and fp32 (IEEE dots) queries; both routes of the
    Triton kernel."""
    from jetrl.quant.kernels import tuning

    with tuning.override(kv_decode_factored=factored, kv_decode_streams=False):
        _paged_decode_fp8_group_of_6(dtype)


def _paged_decode_fp8_group_of_6(dtype):
    from jetrl.models.attention import paged_attention_reference
    from jetrl.quant.kernels.paged_attention_triton import FP8_BLOCK_N, choose_num_splits, paged_decode

    gen = torch.Generator(device="cuda").manual_seed(6)
    contexts, hq, hkv = [1, 4099, 6000, 17], 12, 2
    meta, kd, ks, vd, vs = paged_case(gen, contexts, [1] * len(contexts), PAGE, hkv, D, "cuda", shared_blocks=1)
    q = torch.randn(len(contexts), hq, D, generator=gen, device="cuda").to(dtype)
    assert choose_num_splits(len(contexts), hkv, meta.max_context_len, q.device, FP8_BLOCK_N) > 1
    kq, vq = dequantize_kv_ref(kd, ks, dtype), dequantize_kv_ref(vd, vs, dtype)
    ref = paged_attention_reference(q.float(), kq.float(), vq.float(), meta, D ** -0.5)
    # bf16: as above; fp32: summation order (no rounding of P), with room for the reference's own GPU kernels
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    for kw in ({}, {"num_splits": 1}, {"num_splits": 7}, {"block_n": 16}):
        a, b, _, _ = attend(paged_decode, q, meta, kd, ks, vd, vs, **kw)
        assert a.dtype == dtype and torch.isfinite(a).all(), kw
        assert rel_err(a, ref) < tol and rel_err(b, ref) < tol, (kw, rel_err(a, ref), rel_err(b, ref))


@pytest.mark.gpu
@pytest.mark.parametrize("num_seqs", sorted(DECODE_BATCHES))
def test_exact_attention_fp8_decode_at_8b_shapes(num_seqs):
    from jetrl.models.attention import exact_attention_reference
    from jetrl.quant.kernels.exact_attention_triton import exact_attention_fwd

    q, meta, kd, ks, vd, vs = _decode_case(num_seqs)
    a, b, kq, vq = attend(exact_attention_fwd, q, meta, kd, ks, vd, vs)
    assert same_bits(a, b)
    assert rel_err(a, exact_attention_reference(q, kq, vq, meta, D ** -0.5)) < 1e-2


@pytest.mark.gpu
def test_exact_attention_fp8_prefill_and_packed_at_8b_shapes():
    from jetrl.models.attention import exact_attention_reference, packed_as_paged
    from jetrl.quant.kernels.exact_attention_triton import exact_attention_fwd

    # prefill chunks: 5 sequences with 1 .. 300 new rows each, over partial pages and shared prefix blocks
    q, meta, kd, ks, vd, vs = _decode_case(5, q_lens=[1, 17, 300, 64, 1])
    a, b, kq, vq = attend(exact_attention_fwd, q, meta, kd, ks, vd, vs)
    assert same_bits(a, b)
    assert rel_err(a, exact_attention_reference(q, kq, vq, meta, D ** -0.5)) < 1e-2
    # the trainer's packed layout: one-token pages, scales (N, 1, Hkv)
    gen = torch.Generator(device="cuda").manual_seed(1)
    cu = [0, 1, 200, 1224, 1300]
    k, ks = quantize_kv_ref(kv_values(gen, (cu[-1], HKV, D), "cuda").to(torch.bfloat16))
    v, vs = quantize_kv_ref(kv_values(gen, (cu[-1], HKV, D), "cuda").to(torch.bfloat16))
    q = torch.randn(cu[-1], HQ, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    meta = packed_as_paged(cu, "cuda")
    a, b, kq, vq = attend(exact_attention_fwd, q, meta, k[:, None], ks[:, None], v[:, None], vs[:, None])
    assert same_bits(a, b)
    assert rel_err(a, exact_attention_reference(q, kq, vq, meta, D ** -0.5)) < 1e-2
