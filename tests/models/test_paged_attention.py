"""Paged attention reference and the model's cached path against plain attention / the full forward."""

from __future__ import annotations

import pytest
import torch

import jetrl.models as jm
from jetrl.models.attention import PagedAttentionMetadata, PagedKVCache
from conftest import VOCAB, rel_err


def naive_attention(q, k, v, scale):  # q (Lq, Hq, D) are the LAST Lq positions of k/v (Lk, Hkv, D)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    offset = k.shape[0] - q.shape[0]
    causal = torch.arange(k.shape[0])[None, :] <= (torch.arange(q.shape[0])[:, None] + offset)
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double())


def scatter_blocks(lengths, block_size, num_blocks, gen):
    """Random, non-contiguous block tables (padded with -1) for sequences of ``lengths`` cache tokens."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    need = [-(-n // block_size) for n in lengths]
    width = max(need) + 1  # one extra unused column: -1 entries must be harmless
    tables = torch.full((len(lengths), width), -1, dtype=torch.int32)
    for s, b in enumerate(need):
        tables[s, :b] = torch.tensor([perm.pop() for _ in range(b)], dtype=torch.int32)
    return tables


def slots_for(tables, block_size, seq, positions):
    return [int(tables[seq, p // block_size]) * block_size + p % block_size for p in positions]


def test_reference_mixed_prefill_and_decode(gen):
    hq, hkv, d, bs, num_blocks = 6, 2, 16, 4, 32
    cache = PagedKVCache.allocate(1, num_blocks, bs, hkv, d, torch.float32, "cpu")
    cached, new = [9, 0, 4, 13], [1, 6, 3, 1]  # decode, fresh prefill, chunked prefill, decode
    totals = [c + n for c, n in zip(cached, new)]
    tables = scatter_blocks(totals, bs, num_blocks, gen)
    ks = [torch.randn(t, hkv, d, generator=gen) for t in totals]
    vs = [torch.randn(t, hkv, d, generator=gen) for t in totals]
    for s, t in enumerate(totals):  # pre-existing cache content
        slots = torch.tensor(slots_for(tables, bs, s, range(cached[s])), dtype=torch.long)
        jm.write_kv(cache.k[0], cache.v[0], ks[s][:cached[s]], vs[s][:cached[s]], slots)
    slot_mapping = torch.tensor(sum((slots_for(tables, bs, s, range(cached[s], totals[s])) for s in range(4)), []))
    jm.write_kv(cache.k[0], cache.v[0], torch.cat([k[c:] for k, c in zip(ks, cached)]),
                torch.cat([v[c:] for v, c in zip(vs, cached)]), slot_mapping)
    qsl = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    meta = PagedAttentionMetadata(qsl, torch.tensor(totals, dtype=torch.int32), tables, slot_mapping,
                                  max(new), max(totals))
    assert not meta.is_decode
    q = torch.randn(sum(new), hq, d, generator=gen)
    out = jm.paged_attention(q, cache.k[0], cache.v[0], meta, 0.25)
    ref = torch.cat([naive_attention(q[qsl[s]:qsl[s + 1]], ks[s], vs[s], 0.25) for s in range(4)])
    assert out.shape == q.shape
    assert rel_err(out, ref) < 1e-6  # fp32 attention vs fp64: fp32 rounding only


def test_reference_decode_only(gen):
    hq, hkv, d, bs = 4, 4, 8, 16
    totals = [1, 40, 17]
    cache = PagedKVCache.allocate(2, 16, bs, hkv, d, torch.float32, "cpu")
    tables = scatter_blocks(totals, bs, 16, gen)
    ks = [torch.randn(t, hkv, d, generator=gen) for t in totals]
    vs = [torch.randn(t, hkv, d, generator=gen) for t in totals]
    for s, t in enumerate(totals):
        slots = torch.tensor(slots_for(tables, bs, s, range(t)))
        jm.write_kv(cache.k[1], cache.v[1], ks[s], vs[s], slots)
    last = torch.tensor([slots_for(tables, bs, s, [t - 1])[0] for s, t in enumerate(totals)])
    meta = PagedAttentionMetadata(torch.arange(4, dtype=torch.int32), torch.tensor(totals, dtype=torch.int32),
                                  tables, last, 1, max(totals))
    assert meta.is_decode
    q = torch.randn(3, hq, d, generator=gen)
    out = jm.paged_attention_reference(q, cache.k[1], cache.v[1], meta, d ** -0.5)
    ref = torch.cat([naive_attention(q[s:s + 1], ks[s], vs[s], d ** -0.5) for s in range(3)])
    assert rel_err(out, ref) < 1e-6


@pytest.mark.parametrize("hq,hkv,d,dtype", [(6, 2, 64, torch.bfloat16), (9, 3, 64, torch.float32),
                                             (7, 1, 128, torch.bfloat16), (8, 8, 128, torch.float32)])
def test_cpu_reference_shares_kv_heads_with_the_same_bits_as_repeating_them(gen, hq, hkv, d, dtype):
    """On the CPU the reference lets SDPA share each KV head among its query heads (no repeated copies); that is
    the same float64 computation as repeating the heads, bit for bit (GQA groups 1-7, decode and prefill rows)."""
    import torch.nn.functional as F

    bs, num_blocks = 16, 24
    cache = PagedKVCache.allocate(1, num_blocks, bs, hkv, d, dtype, "cpu")
    cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=gen))
    cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=gen))
    totals, new = [37, 1, 70, 5], [1, 1, 9, 5]
    tables = scatter_blocks(totals, bs, num_blocks, gen)
    qsl = torch.tensor([0] + new).cumsum(0).to(torch.int32)
    meta = PagedAttentionMetadata(qsl, torch.tensor(totals, dtype=torch.int32), tables,
                                  torch.zeros(sum(new), dtype=torch.long), max(new), max(totals))
    q = torch.randn(sum(new), hq, d, generator=gen).to(dtype)
    out = jm.paged_attention_reference(q, cache.k[0], cache.v[0], meta, d ** -0.5)
    group, width = hq // hkv, tables.shape[1] * bs
    for s in range(4):
        rows = q[qsl[s]:qsl[s + 1]].transpose(0, 1)[None].double()  # (1, Hq, n, D)
        blocks = tables[s].clamp(min=0).long()
        keys, values = (c[0][blocks].reshape(width, hkv, d).transpose(0, 1).repeat_interleave(group, 0)[None].double()
                        for c in (cache.k, cache.v))
        limit = totals[s] - (new[s] - 1 - torch.arange(new[s]))
        mask = torch.arange(width)[None, :] < limit[:, None]
        ref = F.scaled_dot_product_attention(rows, keys, values, attn_mask=mask[None, None], scale=d ** -0.5)
        expect = ref[0].transpose(0, 1).to(dtype)
        assert torch.equal(out[qsl[s]:qsl[s + 1]].view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           expect.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), s


def test_allocate_rejects_bad_sizes():
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache.allocate(2, 8, 0, 2, 64, torch.bfloat16, "cpu")
    cache = PagedKVCache.allocate(3, 8, 16, 2, 64, torch.bfloat16, "cpu")
    assert cache.num_layers == 3 and cache.k[0].shape == (8, 16, 2, 64) and cache.k[0].dtype == torch.bfloat16


@pytest.mark.parametrize("variant", ["llama", "qwen2", "qwen3"])
def test_forward_paged_matches_full_forward(hf_checkpoints, variant, gen):
    """Chunked prefill then decoding through the paged cache reproduces the full forward's logits."""
    model = jm.load_model(hf_checkpoints[variant][0], dtype=torch.float32)
    cfg, bs, num_blocks = model.config, 8, 24
    lengths = [19, 7]  # two sequences generated side by side
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    with torch.no_grad():
        full = [model(s[None])[0].float() for s in seqs]
    cache = PagedKVCache.allocate(cfg.num_hidden_layers, num_blocks, bs, cfg.num_key_value_heads, cfg.head_dim,
                                  torch.float32, "cpu")
    tables = scatter_blocks(lengths, bs, num_blocks, gen)
    # steps: (new tokens of seq 0, new tokens of seq 1); prefill in two chunks, then decode to the end
    steps = [(10, 4), (5, 3)] + [(1, 0)] * 4
    done = [0, 0]
    got = [[], []]
    for step in steps:
        active = [s for s in range(2) if step[s] > 0]
        ids, pos, slots, logit_rows, qsl = [], [], [], [], [0]
        for s in active:
            rng = range(done[s], done[s] + step[s])
            ids.append(seqs[s][rng.start:rng.stop])
            pos.append(torch.arange(rng.start, rng.stop))
            slots += slots_for(tables, bs, s, rng)
            qsl.append(qsl[-1] + step[s])
        meta = PagedAttentionMetadata(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            context_lens=torch.tensor([done[s] + step[s] for s in active], dtype=torch.int32),
            block_tables=tables[active], slot_mapping=torch.tensor(slots, dtype=torch.long),
            max_query_len=max(step[s] for s in active), max_context_len=max(done[s] + step[s] for s in active))
        with torch.no_grad():
            logits = model.forward_paged(torch.cat(ids), torch.cat(pos), meta, cache)
        assert logits.dtype == torch.float32 and logits.shape == (sum(step), VOCAB)
        for i, s in enumerate(active):
            got[s].append(logits[qsl[i]:qsl[i + 1]])
            done[s] += step[s]
    for s in range(2):
        assert rel_err(torch.cat(got[s]), full[s]) < 1e-5  # fp32, same ops, different reduction order


def test_forward_paged_logits_indices(hf_checkpoints, gen):
    model = jm.load_model(hf_checkpoints["llama"][0], dtype=torch.float32)
    cfg = model.config
    ids = torch.randint(0, VOCAB, (12,), generator=gen)
    cache = PagedKVCache.allocate(cfg.num_hidden_layers, 4, 4, cfg.num_key_value_heads, cfg.head_dim,
                                  torch.float32, "cpu")
    tables = torch.tensor([[2, 0, 3]], dtype=torch.int32)
    meta = PagedAttentionMetadata(torch.tensor([0, 12], dtype=torch.int32), torch.tensor([12], dtype=torch.int32),
                                  tables, torch.tensor(slots_for(tables, 4, 0, range(12))), 12, 12)
    with torch.no_grad():
        last = model.forward_paged(ids, torch.arange(12), meta, cache, logits_indices=torch.tensor([11]))
        full = model(ids[None])[0]
    assert last.shape == (1, VOCAB)
    assert rel_err(last[0], full[11]) < 1e-5
    bad = PagedKVCache.allocate(1, 4, 4, cfg.num_key_value_heads, cfg.head_dim, torch.float32, "cpu")
    with pytest.raises(ValueError, match="layers"):
        model.forward_paged(ids, torch.arange(12), meta, bad)


def test_sdpa_backends_leave_cpu_alone():
    """On the CPU the context is empty (entering sdpa_kernel costs host time per call and cuDNN is CUDA's only)."""
    from jetrl.models.attention import sdpa_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with sdpa_backends(torch.zeros(1)):
        assert torch.backends.cuda.cudnn_sdp_enabled() == before


@pytest.mark.gpu
def test_sdpa_backends_leave_out_cudnn_on_cuda():
    """cuDNN attention builds a graph per new sequence length (a large cost at every packed step): off inside the
    context, flash attention on, and the global setting restored after it."""
    from jetrl.models.attention import sdpa_backends

    before = torch.backends.cuda.cudnn_sdp_enabled()
    with sdpa_backends(torch.zeros(1, device="cuda")):
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled() == before
