"""The FP8 KV cache's numerics (CPU): the 1 x head_dim quantization against the linears' 1x128 reference, the
FP8 pools written by ``write_kv`` and read by both attentions against the training side's attention over
fake-quantized K/V, and the straight-through gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from jetrl.models import DecoderConfig, build_model
from jetrl.models.attention import (
    PagedAttentionMetadata,
    PagedKVCache,
    dequantize_kv,
    exact_attention,
    exact_varlen_attention,
    fake_quantize_kv,
    paged_attention,
    quantize_kv,
    varlen_attention,
    write_kv,
)
from jetrl.quant import ACT
from jetrl.quant import reference as ref

E4M3 = torch.float8_e4m3fn


def _kv(gen, n, hkv, d, dtype=torch.bfloat16):
    """Random K/V rows with per-row magnitudes over several decades and an all-zero row (the 1e-4 amax floor)."""
    x = torch.randn(n, hkv, d, generator=gen) * torch.logspace(-3, 2, n)[:, None, None]
    x[n // 2, 0] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_kv_is_the_1x128_activation_quantization_with_pow2_scales(gen, dtype):
    x = _kv(gen, 37, 3, 128, dtype)
    data, scale = quantize_kv(x)
    want_data, want_scale = ref.quantize(x.reshape(-1, 128), ACT, pow2_scale=True)
    assert data.dtype == E4M3 and data.shape == x.shape and scale.dtype == torch.float32 and scale.shape == (37, 3)
    assert torch.equal(data.view(torch.uint8).reshape(-1, 128), want_data.view(torch.uint8))
    assert torch.equal(scale.reshape(-1, 1), want_scale)
    # head_dim 64: the same formula over 64 values, i.e. the 1x128 quantization of the row padded with zeros
    x64 = _kv(gen, 11, 2, 64, dtype)
    data, scale = quantize_kv(x64)
    want_data, want_scale = ref.quantize(F.pad(x64.reshape(-1, 64).float(), (0, 64)), ACT, pow2_scale=True)
    assert torch.equal(data.view(torch.uint8).reshape(-1, 64), want_data[:, :64].view(torch.uint8))
    assert torch.equal(scale.reshape(-1, 1), want_scale)


def _extreme_kv() -> torch.Tensor:
    """fp32 K/V rows (N, 1, 128) at the edges of quantize_kv's ranges: all zeros and amax below the 1e-4 floor
    (scale 2^-22, down to its smallest nonzero value 2^-9 * 2^-22), E4M3 subnormals next to the block max, amax 1e-4
    exactly, amax near 1 and near the fp32 limit (scale 2^120)."""
    grid = torch.linspace(-1.0, 1.0, 128)
    rows = [torch.zeros(128), grid * 3e-5, grid * 1e-4, grid * 0.999, grid * 1.001,
            torch.cat([torch.tensor([448.0, 2.0 ** -9, -(2.0 ** -8), 3 * 2.0 ** -9]), grid[4:]]),
            grid * 3.2e38, torch.tensor([1e-30, -1e-38] + [7.0] * 126),
            torch.tensor([9e-5, 2.0 ** -31, -(2.0 ** -30)] + [0.0] * 125)]  # E4M3's smallest subnormal at 2^-22
    return torch.stack(rows)[:, None]


def test_pow2_kv_scales_make_the_dequantized_values_exact():
    """The facts dequantize_kv's docstring argues and the kernels build on: power-of-two scales in [2^-22, 2^120];
    the dequantized value exact in fp32 and bf16 (so the bf16 cache holds data * scale unrounded); no value below
    2^-31 besides 0; overflow only within 1/32 of the fp32 limit."""
    x = torch.cat([_extreme_kv(), _kv(torch.Generator().manual_seed(1), 64, 1, 128, torch.float32)])
    data, scale = quantize_kv(x)
    e = torch.log2(scale)
    assert torch.equal(e, e.round()) and e.min() == -22 and e.max() == 120, e.flatten()
    exact = data.double() * scale.double()[..., None]  # the true product
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(dequantize_kv(data, scale, dtype).double(), exact), dtype
        # the same exact value from a product in dtype itself: nothing rounds
        assert torch.equal((data.to(dtype) * scale.to(dtype)[..., None]).double(), exact), dtype
    nonzero = exact[exact != 0].abs()
    assert nonzero.min() == 2.0 ** -31 and torch.isfinite(exact).all()
    # the one overflow: |x| >= 248 * 2^120 (x / 2^120 rounds up to 256 in E4M3), about 3.3e38
    big = torch.tensor([[[3.2e38] + [0.0] * 127], [[3.3e38] + [0.0] * 127]])
    d_big, s_big = quantize_kv(big)
    assert torch.equal(s_big.flatten(), torch.full((2,), 2.0 ** 120))
    deq = dequantize_kv(d_big, s_big, torch.float32)[:, 0, 0]
    assert deq[0] == 240 * 2.0 ** 120 and deq[1] == float("inf")


def test_fake_quantize_kv_values_and_straight_through_gradient(gen):
    x = _kv(gen, 9, 2, 32).requires_grad_(True)
    y = fake_quantize_kv(x)
    assert y.dtype == x.dtype and torch.isfinite(y).all()
    assert torch.equal(y, dequantize_kv(*quantize_kv(x.detach()), torch.bfloat16))
    rel = ((y.float() - x.float()).abs() / x.float().abs().amax(-1, keepdim=True).clamp_min(1e-4)).max()
    # E4M3 keeps 3 mantissa bits: at most half an ulp (16 * scale at |x / scale| >= 256, the power-of-two scale's
    # worst case) over the block max (>= 256 * scale then)
    assert 0 < rel <= 2 ** -4
    w = torch.randn(x.shape, generator=gen)
    (y.float() * w).sum().backward()
    assert torch.equal(x.grad, w.to(x.dtype))  # the identity: the gradient reaches the BF16 K/V unchanged


def _scatter(gen, lengths, block_size, num_blocks):
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    need = [-(-n // block_size) for n in lengths]
    tables = torch.full((len(lengths), max(need) + 1), -1, dtype=torch.int32)
    for s, b in enumerate(need):
        tables[s, :b] = torch.tensor([perm.pop() for _ in range(b)], dtype=torch.int32)
    return tables


def _slots(tables, bs, s, positions):
    return [int(tables[s, p // bs]) * bs + p % bs for p in positions]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache_attention_equals_attention_over_fake_quantized_kv(gen, dtype):
    """Prefill chunks and decode rows over partially filled pages: write_kv stores quantize_kv's bytes and
    scales; the paged reference over the FP8 cache is bitwise itself over the dequantized cache and matches
    the training side's SDPA over fake-quantized K/V to fp32 summation order; exact attention matches the
    packed exact attention over fake-quantized K/V bitwise."""
    hq, hkv, d, bs, num_blocks = 4, 2, 32, 4, 40
    cached, new = [9, 0, 4, 13], [1, 6, 3, 1]  # decode, fresh prefill, chunked prefill, decode
    totals = [c + n for c, n in zip(cached, new)]
    tables = _scatter(gen, totals, bs, num_blocks)
    cache = PagedKVCache.allocate(1, num_blocks, bs, hkv, d, dtype, "cpu", kv_fp8=True)
    assert cache.is_fp8 and cache.k[0].dtype == E4M3 and cache.k_scale[0].shape == (num_blocks, bs, hkv)
    ks = [_kv(gen, t, hkv, d, dtype) for t in totals]
    vs = [_kv(gen, t, hkv, d, dtype) for t in totals]
    k_layer, v_layer, k_scale, v_scale = cache.layer(0)
    for s in range(4):  # earlier steps
        slots = torch.tensor(_slots(tables, bs, s, range(cached[s])), dtype=torch.long)
        write_kv(k_layer, v_layer, ks[s][:cached[s]], vs[s][:cached[s]], slots, k_scale, v_scale)
    slot_mapping = torch.tensor(sum((_slots(tables, bs, s, range(cached[s], totals[s])) for s in range(4)), []))
    write_kv(k_layer, v_layer, torch.cat([k[c:] for k, c in zip(ks, cached)]),
             torch.cat([v[c:] for v, c in zip(vs, cached)]), slot_mapping, k_scale, v_scale)
    for s in range(4):  # the stored bytes and scales are quantize_kv's
        slots = torch.tensor(_slots(tables, bs, s, range(totals[s])))
        data, scale = quantize_kv(ks[s])
        assert torch.equal(k_layer.view(-1, hkv, d)[slots].view(torch.uint8), data.view(torch.uint8))
        assert torch.equal(k_scale.view(-1, hkv)[slots], scale)
    qsl = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    meta = PagedAttentionMetadata(qsl, torch.tensor(totals, dtype=torch.int32), tables, slot_mapping, max(new),
                                  max(totals))
    q = torch.randn(sum(new), hq, d, generator=gen).to(dtype)
    out = paged_attention(q, k_layer, v_layer, meta, d ** -0.5, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    # bitwise the same function over a cache holding the dequantized values
    assert torch.equal(out, paged_attention(q, dequantize_kv(k_layer, k_scale, dtype),
                                            dequantize_kv(v_layer, v_scale, dtype), meta, d ** -0.5))
    # the training side: causal SDPA over fake-quantized K/V of each whole sequence, its last rows
    fq_k, fq_v = [fake_quantize_kv(k) for k in ks], [fake_quantize_kv(v) for v in vs]
    want = torch.cat([varlen_attention(torch.cat([torch.zeros(cached[s], hq, d, dtype=dtype),
                                                  q[qsl[s]:qsl[s + 1]]]), fq_k[s], fq_v[s], [0, totals[s]],
                                       d ** -0.5)[cached[s]:] for s in range(4)])
    # the same values in, two summation orders out: fp32 rounding (bf16: the fp32 results, a rounding apart,
    # may round to neighbouring bf16 values, one ulp = 2^-7 relative at most)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-5)
    torch.testing.assert_close(out, want, **tol)
    # decode rows alone (the decode kernel's path)
    decode = [0, 3]
    rows = [int(qsl[s]) for s in decode]
    dmeta = PagedAttentionMetadata(torch.arange(3, dtype=torch.int32), meta.context_lens[decode], tables[decode],
                                   slot_mapping[rows], 1, max(totals))
    assert dmeta.is_decode
    torch.testing.assert_close(paged_attention(q[rows], k_layer, v_layer, dmeta, d ** -0.5, k_scale=k_scale,
                                               v_scale=v_scale), want[rows], **tol)
    # exact mode: the whole sequences as one prefill over the FP8 cache == the packed exact attention over
    # fake-quantized K/V, bit for bit
    full_q = [torch.randn(t, hq, d, generator=gen).to(dtype) for t in totals]
    cu = torch.tensor([0] + totals).cumsum(0)
    full_meta = PagedAttentionMetadata(cu.to(torch.int32), torch.tensor(totals, dtype=torch.int32), tables,
                                       torch.zeros(int(cu[-1]), dtype=torch.long), max(totals), max(totals))
    paged = exact_attention(torch.cat(full_q), k_layer, v_layer, full_meta, d ** -0.5, k_scale=k_scale,
                            v_scale=v_scale)
    packed = exact_varlen_attention(torch.cat(full_q), torch.cat(fq_k), torch.cat(fq_v), cu.tolist(), d ** -0.5)
    assert torch.isfinite(paged).all() and torch.equal(paged, packed)


def test_fp8_cache_layout_bytes_and_errors():
    bf16 = PagedKVCache.allocate(2, 8, 16, 2, 128, torch.bfloat16, "cpu")
    fp8 = PagedKVCache.allocate(2, 8, 16, 2, 128, torch.bfloat16, "cpu", kv_fp8=True)
    assert not bf16.is_fp8 and bf16.layer(1)[2] is None
    assert fp8.is_fp8 and fp8.v[1].dtype == E4M3 and fp8.v_scale[1].dtype == torch.float32
    assert bf16.nbytes() == 2 * 2 * 8 * 16 * 2 * 128 * 2
    assert fp8.nbytes() == 2 * 2 * 8 * 16 * 2 * (128 + 4)  # 1 byte a value, a 4-byte scale per token and head
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        PagedKVCache(fp8.k, fp8.v, 16, k_scale=fp8.k_scale)
    with pytest.raises(ValueError, match="scales go with torch.float8_e4m3fn pools"):
        PagedKVCache(bf16.k, bf16.v, 16, k_scale=fp8.k_scale, v_scale=fp8.v_scale)
    k = torch.zeros(1, 2, 128)
    slots = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="both k_scale and v_scale"):
        write_kv(fp8.k[0], fp8.v[0], k, k, slots, fp8.k_scale[0])
    with pytest.raises(ValueError, match="scales go with torch.float8_e4m3fn pools"):
        write_kv(bf16.k[0], bf16.v[0], k, k, slots, fp8.k_scale[0], fp8.v_scale[0])


def test_forward_packed_kv_fp8_changes_attention_and_trains_k_and_v(gen):
    """jet with FP8 K/V: the values differ from BF16 K/V (by E4M3 rounding), the gradient reaches k_proj and
    v_proj, and its direction is that of the BF16 K/V's (straight through)."""
    cfg = DecoderConfig(model_type="llama", vocab_size=128, hidden_size=128, intermediate_size=256,
                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    model = build_model(cfg, dtype=torch.float32, recipe="jet", seed=0)
    ids = torch.randint(0, 128, (20,), generator=gen)
    pos = torch.cat([torch.arange(12), torch.arange(8)])
    grads, outs = {}, {}
    for kv_fp8 in (False, True):
        model.zero_grad()
        hidden = model.forward_packed(ids, pos, torch.tensor([0, 12, 20]), kv_fp8=kv_fp8)
        hidden.float().square().mean().backward()
        attn = model.model.layers[0].self_attn
        grads[kv_fp8] = torch.cat([attn.k_proj.weight.grad.flatten(), attn.v_proj.weight.grad.flatten()])
        outs[kv_fp8] = hidden.detach()
    assert torch.isfinite(grads[True]).all() and grads[True].abs().sum() > 0
    assert not torch.equal(outs[True], outs[False])
    rel = (outs[True] - outs[False]).norm() / outs[False].norm()
    cos = F.cosine_similarity(grads[True], grads[False], dim=0)
    assert 0 < rel < 0.1 and cos > 0.9, (rel, cos)  # E4M3 rounding: a few percent per value at most


def test_an_fp8_cache_without_its_scales_is_an_error():
    """E4M3 pools read or written without their scale pools (or scales with a cache in the model's dtype) would
    attend over unscaled bytes: each entry point says so before any math."""
    bf16 = PagedKVCache.allocate(1, 4, 4, 1, 16, torch.bfloat16, "cpu")
    fp8 = PagedKVCache.allocate(1, 4, 4, 1, 16, torch.bfloat16, "cpu", kv_fp8=True)
    meta = PagedAttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                                  torch.tensor([[0]], dtype=torch.int32), torch.tensor([2]), 1, 3)
    q = torch.randn(1, 2, 16, dtype=torch.bfloat16)
    for attend in (paged_attention, exact_attention):
        with pytest.raises(ValueError, match="torch.float8_e4m3fn cache needs its k_scale and v_scale"):
            attend(q, fp8.k[0], fp8.v[0], meta, 0.25)
        with pytest.raises(ValueError, match="scales go with torch.float8_e4m3fn pools"):
            attend(q, bf16.k[0], bf16.v[0], meta, 0.25, k_scale=fp8.k_scale[0], v_scale=fp8.v_scale[0])
    with pytest.raises(ValueError, match="torch.float8_e4m3fn cache needs its k_scale and v_scale"):
        write_kv(fp8.k[0], fp8.v[0], q[:, :1], q[:, :1], meta.slot_mapping)
