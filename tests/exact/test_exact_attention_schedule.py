"""Exact mode's attention schedule on plain CPU (no kernel runs): the device-side program numbering covers every
query row once, within the grid's bound, and a step of at most one row per sequence (a decode step) runs the
swapped decode kernel, one row per program, while prefill and training tiles keep 64 MMA rows."""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton) ")


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
    program numbering (made once per forward) says so; prefill and training tiles keep 64 MMA rows.
    ``_schedule`` returns (rows per program, swapped)."""
    from jetrl.models.attention import PagedAttentionMetadata
    from jetrl.quant.kernels.exact_attention_triton import _schedule, number_tiles

    def meta(rows_per_seq):
        qsl = torch.tensor([0] + torch.tensor(rows_per_seq).cumsum(0).tolist(), dtype=torch.int32)
        n = len(rows_per_seq)
        return PagedAttentionMetadata(qsl, torch.full((n,), 300, dtype=torch.int32),
                                      torch.zeros(n, 20, dtype=torch.int32),
                                      torch.zeros(int(qsl[-1]), dtype=torch.long), max(rows_per_seq), 300), int(qsl[-1])

    block_q = 64 // triton_next_pow2(heads // kv_heads)
    decode, n = meta([1, 1, 1, 1, 1])
    assert _schedule(decode, n, heads, kv_heads) == (1, True)
    assert number_tiles(decode, n, heads, kv_heads)[:2] == (1, n)
    mixed, n = meta([2, 0, 1, 0, 1])  # rows <= sequences: still a per-row schedule, every row its own program
    assert _schedule(mixed, n, heads, kv_heads) == (1, True)
    prefill, n = meta([7, 300, 1])
    assert _schedule(prefill, n, heads, kv_heads) == (block_q, False)
    assert number_tiles(prefill, n, heads, kv_heads)[:2] == (block_q, n)


def triton_next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()
