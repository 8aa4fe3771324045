"""Exact mode's attention kernel with several tiles per program (``exact_attention_tiles_per_program``): under
TRITON_INTERPRET=1 (see ``tests/interpreted.py``), for T = 1, 2, 3 the kernel's output equals the kernel before
the multi-tile schedule (``one_tile_exact_attention.py``, kept verbatim) bit for bit: the packed training forward
over sequences of mixed lengths (one-token sequences, lengths on both sides of the 16-row tile and of the 64-key
chunk, a GQA group of 3 with padding rows) and prefill chunks over a shuffled FP8 paged cache with scales. Plain
CPU: the device-side program numbering covers every query row once, within the grid's bound, and a bad setting
is an error. Stacked tiles (``exact_attention_stacked``: one dot of T x 64 rows) are checked here to fp32
rounding only: numpy's sgemm does not give a row the same bits in a 128-row product as in a 64-row one (on the
GPU each 64-row group issues the one-tile kernel's MMA instructions; test_exact_tiles_gpu.py checks the bits).

Under the interpreter each tile's ``tl.dot`` is numpy's sgemm on the same operands at the same tile positions as
in the one-tile kernel, so equal bits here check the schedule (which chunks each tile runs, in which order, with
which rows); the MMA's bits at bf16 are test_exact_tiles_gpu.py's."""

import importlib.util

import pytest
import torch

from interpreted import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton) ")

_CHILD = r'''
import json, sys
import torch
sys.path.insert(0, "tests/exact")
from one_tile_exact_attention import one_tile_exact_attention
from jetrl.quant.kernels import tuning
from jetrl.quant.kernels.exact_attention_triton import exact_attention_fwd
from jetrl.models.attention import PagedAttentionMetadata, packed_as_paged, quantize_kv

out = {}
g = torch.Generator().manual_seed(0)

def check(name, q, kc, vc, meta, ks=None, vs=None):
    want = one_tile_exact_attention(q, kc, vc, meta, 0.25, k_scale=ks, v_scale=vs)
    for tiles in (1, 2, 3):
        with tuning.override(exact_attention_tiles_per_program=tiles):
            got = exact_attention_fwd(q, kc, vc, meta, 0.25, k_scale=ks, v_scale=vs)
        out[f"{name}-T{tiles}"] = bool(torch.equal(got, want))
    # stacked tiles: one dot of T x 64 rows, whose bits numpy's sgemm does not keep per row (the GPU's MMA does:
    # test_exact_tiles_gpu.py); here the schedule's rows, masks and chunks, to fp32 rounding
    tol = 2e-3 if q.dtype == torch.float16 else 1e-5
    for tiles in (2, 4):
        with tuning.override(exact_attention_tiles_per_program=tiles, exact_attention_stacked=True):
            got = exact_attention_fwd(q, kc, vc, meta, 0.25, k_scale=ks, v_scale=vs)
        out[f"{name}-stacked{tiles}-close"] = bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol))

# packed training forward (one-token pages): lengths around the 16-row tile and the 64-key chunk
lengths = [1, 16, 17, 40, 70, 1, 130]
cu = [0]
for L in lengths:
    cu.append(cu[-1] + L)
for dtype, hq, hkv in ((torch.float32, 8, 2), (torch.float16, 6, 2)):
    q = torch.randn(cu[-1], hq, 16, generator=g).to(dtype)
    k = torch.randn(cu[-1], hkv, 16, generator=g).to(dtype)
    v = torch.randn(cu[-1], hkv, 16, generator=g).to(dtype)
    check(f"packed-{str(dtype)[6:]}-g{hq // hkv}", q, k[:, None], v[:, None], packed_as_paged(cu, "cpu"))
# prefill chunks over an FP8 paged cache (pages of 8, shuffled): the last rows of contexts of mixed lengths
ctx = [1, 9, 75, 100]
new = [1, 9, 40, 37]
page = 8
width = -(-max(ctx) // page) + 1
nblocks = sum(-(-L // page) for L in ctx) + 2
perm = torch.randperm(nblocks, generator=g).tolist()
tables = torch.full((len(ctx), width), -1, dtype=torch.int32)
for s, L in enumerate(ctx):
    for j in range(-(-L // page)):
        tables[s, j] = perm.pop()
kf = torch.randn(nblocks, page, 2, 16, generator=g) * 3
vf = torch.randn(nblocks, page, 2, 16, generator=g) * 3
kd, ksc = (t.view(nblocks, page, *t.shape[1:]) for t in quantize_kv(kf.view(-1, 2, 16)))
vd, vsc = (t.view(nblocks, page, *t.shape[1:]) for t in quantize_kv(vf.view(-1, 2, 16)))
qsl = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
meta = PagedAttentionMetadata(qsl, torch.tensor(ctx, dtype=torch.int32), tables,
                              torch.zeros(sum(new), dtype=torch.long), max(new), max(ctx))
for dtype in (torch.float32, torch.float16):
    q = torch.randn(sum(new), 8, 16, generator=g).to(dtype)
    check(f"fp8-prefill-{str(dtype)[6:]}", q, kd, vd, meta, ksc, vsc)
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "multi-tile exact attention", timeout=900)


@pytest.mark.parametrize("case", ["packed-float32-g4", "packed-float16-g3", "fp8-prefill-float32",
                                  "fp8-prefill-float16"])
def test_tiles_per_program_keep_the_one_tile_kernels_bits(interpreted, case):
    results = {k: v for k, v in interpreted.items() if k.startswith(case + "-T")}
    assert len(results) == 3 and all(results.values()), results
    stacked = {k: v for k, v in interpreted.items() if k.startswith(case + "-stacked")}
    assert len(stacked) == 2 and all(stacked.values()), stacked


@pytest.mark.parametrize("rows_per_program", [1, 16, 48])
def test_programs_cover_every_row_once(rows_per_program):
    from jetrl.quant.kernels.exact_attention_triton import _number_tiles

    lengths = [1, 16, 17, 0, 95, 1, 48, 130]
    qsl = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    n = int(qsl[-1])
    seq, start = _number_tiles(qsl, n, rows_per_program)
    assert seq.dtype == start.dtype == torch.int32
    assert seq.shape[0] == min(n, n // rows_per_program + len(lengths))  # the shape-only bound
    live = seq >= 0
    assert int(live.sum()) == sum(-(-L // rows_per_program) for L in lengths)
    assert bool(live[:int(live.sum())].all())  # the programs past the last come last
    covered = torch.zeros(n, dtype=torch.long)
    for s, first in zip(seq[live].tolist(), start[live].tolist()):
        assert qsl[s] <= first < qsl[s + 1]
        covered[first:min(first + rows_per_program, int(qsl[s + 1]))] += 1
    assert bool((covered == 1).all())


@pytest.mark.parametrize("heads,kv_heads", [(32, 8), (40, 8), (8, 8)])
def test_schedule_swaps_decode_steps_only(heads, kv_heads):
    """A step of at most one row per sequence runs the swapped decode kernel, one row per program, and its
    program numbering (made once per forward) says so; prefill and training tiles keep 64 MMA rows; the tuning
    switch turns the swap off. ``_schedule`` returns (rows per tile, tiles per program, swapped)."""
    from jetrl.models.attention import PagedAttentionMetadata
    from jetrl.quant.kernels import tuning
    from jetrl.quant.kernels.exact_attention_triton import _schedule, number_tiles

    def meta(rows_per_seq):
        qsl = torch.tensor([0] + torch.tensor(rows_per_seq).cumsum(0).tolist(), dtype=torch.int32)
        n = len(rows_per_seq)
        return PagedAttentionMetadata(qsl, torch.full((n,), 300, dtype=torch.int32),
                                      torch.zeros(n, 20, dtype=torch.int32),
                                      torch.zeros(int(qsl[-1]), dtype=torch.long), max(rows_per_seq), 300), int(qsl[-1])

    block_q = 64 // triton_next_pow2(heads // kv_heads)
    decode, n = meta([1, 1, 1, 1, 1])
    assert _schedule(decode, n, heads, kv_heads) == (1, 1, True)
    assert number_tiles(decode, n, heads, kv_heads)[:2] == (1, n)
    mixed, n = meta([2, 0, 1, 0, 1])  # rows <= sequences: still a per-row schedule, every row its own program
    assert _schedule(mixed, n, heads, kv_heads) == (1, 1, True)
    with tuning.override(exact_decode_attention_swapped=False):
        assert _schedule(decode, 5, heads, kv_heads) == (block_q, 1, False)
    prefill, n = meta([7, 300, 1])
    with tuning.override(exact_attention_tiles_per_program=2):
        assert _schedule(prefill, n, heads, kv_heads) == (block_q, 2, False)
    assert _schedule(prefill, n, heads, kv_heads) == (block_q, 1, False)


def triton_next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


@pytest.mark.parametrize("bad", [dict(exact_attention_tiles_per_program=0), dict(exact_attention_tiles_per_program=5),
                                 dict(exact_attention_tiles_per_program=True),
                                 dict(exact_attention_tiles_per_program=3, exact_attention_stacked=True)])
def test_bad_tiles_per_program_is_an_error(bad):
    """Rejected when the setting is made, before any kernel runs."""
    from jetrl.quant.kernels import tuning

    with pytest.raises(ValueError, match="exact_attention_tiles_per_program"):
        with tuning.override(**bad):
            pass
