"""Variants of the FP8-cache decode kernel: the tuning's launch fields, and the bit conversion's byte tiles.

* the fields' checks and defaults;
* under the Triton interpreter (a child, tiny shapes): a cache whose rows are not whole 4-byte words, which the bit
  conversion converts as it does the word-aligned copy of the same cache;
* compiled for the H200 (sm_90a) on this machine: the bit conversion gives both dots bf16 operands of ``kWidth`` 2
  (the BF16-cache kernel's) and reads no shared memory a byte at a time;
* the register cap (``kv_decode_max_registers``, Triton's ``maxnreg``): its checks, and a launch that takes it;
* on the GPU at the 8B head shapes: launches that fit 4 programs per SM, within the tolerances of the reference
  and of the default launch.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re

import pytest
import torch

from interpreted import run_interpreted
from test_decode_attention_bits import _compile
from test_kv_fp8_kernels import _SHARED, _decode_case, rel_err

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton) ")

# launches worth measuring (the interpreter ignores stages and registers): 4 programs of 4 warps per SM where
# registers are capped at 128 (no staged copies at 1 stage; 64-token tiles)
GPU_VARIANTS = {"s1-r128": {"kv_decode_num_stages": 1, "kv_decode_max_registers": 128},
                "n64-r128": {"kv_decode_block_n": 64, "kv_decode_max_registers": 128}}

_CHILD = r'''
import json, sys
import torch
from jetrl.quant import reference as R
from jetrl.quant.kernels import tuning
from jetrl.quant.kernels.paged_attention_triton import paged_decode
''' + "\n".join(inspect.getsource(f) for f in _SHARED) + r'''
out = {}
g = torch.Generator().manual_seed(0)
contexts, page, hq, hkv, d = [1, 37, 130], 8, 6, 2, 32  # a one-token context, partial pages, GQA group 3
meta, kd, ks, vd, vs = paged_case(g, contexts, [1] * len(contexts), page, hkv, d, shared_blocks=1)
# rows 2 bytes apart from a word boundary: the bit conversion's byte tiles, against the aligned cache
pad = lambda x: torch.nn.functional.pad(x.view(torch.uint8), (2, 2)).view(torch.float8_e4m3fn)[..., 2:2 + d]
kdu, vdu = pad(kd), pad(vd)
q = torch.randn(len(contexts), hq, d, generator=g).to(torch.bfloat16)
with tuning.override(kv_decode_factored=True):
    runs = [paged_decode(q, k, v, meta, d ** -0.5, ks, vs, num_splits=2, block_n=16) for k, v in ((kd, vd), (kdu, vdu))]
out["unaligned"] = {"bitwise": same_bits(*runs), "offset": kdu.data_ptr() % 4}
with tuning.override(kv_decode_max_registers=128):  # a launch option Triton takes
    out["max-registers"] = same_bits(runs[1], paged_decode(q, kdu, vdu, meta, d ** -0.5, ks, vs, num_splits=2,
                                                           block_n=16))
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "decode attention: the kernel's variants", timeout=600)


def test_byte_route_converts_rows_that_are_not_whole_words(interpreted):
    assert interpreted["unaligned"] == {"bitwise": True, "offset": 2}, interpreted["unaligned"]
    assert interpreted["max-registers"] is True


def test_fields():
    from jetrl.quant.kernels import tuning

    # the defaults: the H200 sweep's fastest launch (docs/benchmark-history.md)
    assert tuning.current().kv_decode_num_stages == 1
    assert tuning.current().kv_decode_max_registers == 128
    for bad in (16, 256, 128.0, True, -1):
        with pytest.raises(ValueError, match=r"kv_decode_max_registers must be 0 \(the compiler's choice\) or an int"):
            with tuning.override(kv_decode_max_registers=bad):
                pass
    from jetrl.quant.kernels.paged_attention_triton import launch_config

    with tuning.override(kv_decode_max_registers=128):
        assert launch_config(True, True).max_registers == 128 and launch_config(False, False).max_registers == 0
    assert launch_config(True, True).max_registers == 128  # the default


def test_wide_offsets_decision():
    """The byte route's offsets are 32-bit unless an element offset into the cache or the scales can pass 2^31 - 1
    (checked on the meta device: no memory)."""
    from jetrl.quant.kernels.decode_splits import cache_offsets_wide as _wide_offsets

    def pool(blocks, dtype=torch.float8_e4m3fn):
        return torch.empty(blocks, 16, 8, 128, dtype=dtype, device="meta")

    edge = 2 ** 31 // (16 * 8 * 128)  # blocks of 16 x 8 x 128 elements: the last element of `edge` blocks is 2^31 - 1
    assert not _wide_offsets(pool(edge), torch.empty(edge, 16, 8, device="meta"))
    assert _wide_offsets(pool(edge + 1)) and _wide_offsets(pool(4), pool(edge + 1))
    assert _wide_offsets(pool(edge + 1)[:, :, :, :64])  # a view: its strides, not its size, decide
    assert _wide_offsets(torch.empty(2 ** 28 + 1, 8, device="meta"))  # scales of 2^31 + 8 elements


# ------------------------------------------------------------------------------------------------------------
# CPU: the kernel compiled for the H200 (sm_90a), no GPU needed


@pytest.fixture(scope="module")
def byte_route():
    return _compile()  # skips only without an NVIDIA backend (tests/sm90_compile.py)


def test_byte_route_feeds_the_dots_as_a_bf16_cache_does(byte_route):
    """Both dots take bf16 operands of ``kWidth`` 2 (a conversion Triton sees through makes it pick 4 for both dots,
    and shuffle q and p between registers), no shared memory is read a byte at a time, and the conversion is a
    prmt (0x9180 and 0xB3A2 kinds) and a packed multiply per pair of values."""
    widths = re.findall(r"dot_op<\{opIdx = (\d), parent = #mma\d*, kWidth = (\d+)\}>", byte_route.asm["ttgir"])
    assert widths and {w for _, w in widths} == {"2"} and {i for i, _ in widths} == {"0", "1"}, set(widths)
    ptx = byte_route.asm["ptx"]
    assert not re.search(r"ld\.shared(\.v\d)?\.[bu]8", ptx)
    prmts, fmas = len(re.findall(r"prmt\.b32 [^;]*0x9180;", ptx)), len(re.findall(r"fma\.rn\.bf16x2", ptx))
    assert prmts > 0 and fmas == 2 * prmts, (prmts, fmas)


# ------------------------------------------------------------------------------------------------------------
# GPU: the variants at the Llama-3.1-8B head shapes


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(GPU_VARIANTS))
@pytest.mark.parametrize("num_seqs", [1, 5, 64])
def test_variants_at_8b_shapes(num_seqs, variant):
    from jetrl.models.attention import paged_attention_reference
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.paged_attention_triton import paged_decode

    q, meta, kd, ks, vd, vs = _decode_case(num_seqs)
    kq, vq = kd.float() * ks[..., None], vd.float() * vs[..., None]
    ref = paged_attention_reference(q.float(), kq, vq, meta, q.shape[-1] ** -0.5)
    for kw in ({}, {"num_splits": 3}, {"block_n": 64}, {"block_n": 256}):
        with tuning.override(kv_decode_streams=False):  # the Triton kernel's variants
            a = paged_decode(q, kd, vd, meta, q.shape[-1] ** -0.5, ks, vs, **kw)
        with tuning.override(kv_decode_streams=False, **GPU_VARIANTS[variant]):
            b = paged_decode(q, kd, vd, meta, q.shape[-1] ** -0.5, ks, vs, **kw)
        assert b.dtype == torch.bfloat16 and torch.isfinite(b).all(), kw
        assert rel_err(b, ref) < 1e-2 and rel_err(b, a) < 1e-2, (kw, rel_err(b, ref), rel_err(b, a))


@pytest.mark.gpu
def test_byte_route_with_64_bit_offsets():
    """A pool of more than 2^31 bytes, the sequences' pages at its far end: the byte route takes 64-bit offsets
    (32-bit ones would wrap) and attends as the default route does."""
    from jetrl.models.attention import paged_attention_reference
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.decode_splits import cache_offsets_wide as _wide_offsets
    from jetrl.quant.kernels.paged_attention_triton import paged_decode

    q, meta, kd, ks, vd, vs = _decode_case(5)
    used = kd.shape[0]
    far = 2 ** 31 // (kd[0].numel()) + 16  # the first block past 2^31 bytes (plus a margin)
    big = [torch.empty((far + used,) + x.shape[1:], dtype=x.dtype, device="cuda") for x in (kd, ks, vd, vs)]
    for b, x in zip(big, (kd, ks, vd, vs)):
        b[far:] = x
    kq, vq = kd.float() * ks[..., None], vd.float() * vs[..., None]
    ref = paged_attention_reference(q.float(), kq, vq, meta, q.shape[-1] ** -0.5)
    meta = dataclasses.replace(meta, block_tables=torch.where(meta.block_tables >= 0, meta.block_tables + far, -1))
    kd, ks, vd, vs = big
    assert _wide_offsets(kd, vd)
    with tuning.override(kv_decode_streams=False):
        b = paged_decode(q, kd, vd, meta, q.shape[-1] ** -0.5, ks, vs)
    a = paged_decode(q, kd, vd, meta, q.shape[-1] ** -0.5, ks, vs)  # the default: the Gluon kernel
    assert rel_err(b, ref) < 1e-2 and rel_err(b, a) < 1e-2, (rel_err(b, ref), rel_err(b, a))
