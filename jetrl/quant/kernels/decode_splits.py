"""What the paged decode-attention kernels share: the merge of a step's context splits (flash-decoding's second
kernel), the GPU's SM count their split policies aim at (the other kernels' launch policies read it too),
whether 32-bit offsets reach every element, and two constants.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.quant.kernels.tuning import COMPILE_OPTIONS

_SM_COUNTS: dict[int, int] = {}
LOG2E = 1.4426950408889634  # the kernels' softmax runs in log2 units (exp2): scores times scale * log2(e)
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (the sequences of a head-major launch)


@triton.jit
def merge_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_os, stride_oh, num_heads,
                        HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                        BLOCK_D: tl.constexpr):
    """Merge a decode step's context splits: partials ``acc`` (S, Hq, NUM_SPLITS, BLOCK_D) and ``(m, l)`` (S, Hq,
    NUM_SPLITS, 2), fp32 and contiguous, ``m`` a split's running maximum in log2 units (``-inf``: the split held no
    token) and ``l`` its sum of ``exp2(s - m)``; writes ``out[seq, head] = sum_j w_j acc_j / sum_j w_j l_j`` with
    ``w_j = exp2(m_j - max m)``. One program per (sequence, query head)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sp_ok = sp < NUM_SPLITS
    base = (seq * num_heads + head) * NUM_SPLITS + sp  # (BLOCK_S,)
    m = tl.load(part_ml_ptr + base * 2, mask=sp_ok, other=float("-inf"))
    l = tl.load(part_ml_ptr + base * 2 + 1, mask=sp_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(sp_ok & (m > float("-inf")), tl.exp2(m - m_max), 0.0)  # (BLOCK_S,)
    acc = tl.load(part_acc_ptr + base[:, None] * BLOCK_D + d[None, :], mask=sp_ok[:, None], other=0.0)
    total = tl.sum(w * l, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)  # (BLOCK_D,)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def split_partials(out: torch.Tensor, splits: int, block_d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The partials a decode step of ``splits`` context splits writes for :func:`merge_splits`, ``out`` (S, Hq, D)
    its output: ``acc`` (S, Hq, splits, block_d) and ``(m, l)`` (S, Hq, splits, 2), fp32; unsplit, ``out`` twice
    (a kernel argument it never touches)."""
    if splits == 1:
        return out, out
    num_seqs, num_heads = out.shape[:2]
    return (torch.empty(num_seqs, num_heads, splits, block_d, dtype=torch.float32, device=out.device),
            torch.empty(num_seqs, num_heads, splits, 2, dtype=torch.float32, device=out.device))


def merge_splits(part_acc: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor, splits: int, block_d: int) -> None:
    """Write ``out`` (S, Hq, D) from the partials of :func:`split_partials` (nothing to do unsplit)."""
    if splits == 1:
        return
    num_seqs, num_heads, head_dim = out.shape
    merge_splits_kernel[(num_seqs, num_heads)](
        part_acc, part_ml, out, out.stride(0), out.stride(1), num_heads, HEAD_DIM=head_dim, NUM_SPLITS=splits,
        BLOCK_S=max(2, triton.next_power_of_2(splits)), BLOCK_D=block_d, num_warps=4, **COMPILE_OPTIONS)


def cache_offsets_wide(*tensors: torch.Tensor) -> bool:
    """Whether an element offset into one of ``tensors`` (its largest: every index at its last value) can pass
    ``2^31 - 1``, the largest 32-bit int."""
    return any(sum((n - 1) * st for n, st in zip(t.shape, t.stride())) > 2 ** 31 - 1 for t in tensors)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (cached per device); 4 on the CPU (the interpreter's stand-in)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


__all__ = ["merge_splits_kernel", "split_partials", "merge_splits", "sm_count", "cache_offsets_wide", "LOG2E",
           "MAX_GRID_Y"]
