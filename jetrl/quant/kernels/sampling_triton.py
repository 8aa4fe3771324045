"""One-kernel sampling for seeded (and greedy) rows without top-k/top-p truncation.

The PyTorch sampler (:func:`jetrl.rollout.sampling.sample`) builds the counter-based noise of seeded rows
with a chain of int64 tensor ops over the whole (B, V) logits, then the Gumbel transform, the argmax and
a full log-softmax: many small kernel launches per decode step, each reading and writing all (B, V)
elements, so at a large vocabulary the sampler costs a noticeable share of a small model's decode step
(docs/benchmark-history.md has the numbers). This kernel does the same in one pass over the logits, each row split
over several programs (about eight per SM over the batch) whose partials a second, tiny kernel merges:

* ``scaled = logits / T`` (IEEE division; T = 1 for greedy rows; 16-bit logits read as their fp32 values), a
  max / sum-of-exponentials of ``scaled`` per tile, folded into the program's and then the row's, for the
  log-probability ``scaled[token] - logsumexp(scaled)``;
* the noise bits from the same 32-bit hash of ``(seed, sample index, position, token id)`` as
  :func:`~jetrl.rollout.sampling.seeded_uniform` (exact: unsigned 32-bit arithmetic wraps like the
  reference's masked int64), ``u = min(((bits >> 8) + 0.5) / 2^24, U_MAX)`` and ``g = -log(-log(u))`` with the
  device's libm ``log`` (the function PyTorch's CUDA ``log`` calls), computed for the one candidate of a tile
  that an approximate ``g`` leaves (the kernel's doc says when that is exact);
* the first index of the largest ``scaled + g`` (of ``logits`` for greedy rows), as ``argmax`` picks it: the
  first index within a tile, the earliest tile of a program, the first program of the row.

The tokens are therefore those of the reference (on the GPU; the interpreter's ``log`` is NumPy's, which
may differ by an ulp), and the log-probability equals the reference's up to fp32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from jetrl.quant.kernels.tuning import COMPILE_OPTIONS, interpreting

from triton.language.extra import libdevice

_INTERPRET = tl.constexpr(interpreting())
U_MAX = tl.constexpr(1.0 - 2.0 ** -24)  # the reference's noise bound (jetrl.rollout.sampling.U_MAX)
# a tile's approximate best is trusted where the second best lies below it by more than NEAR_ABS + |best| * NEAR_REL
NEAR_ABS = tl.constexpr(2.0 ** -12)
NEAR_REL = tl.constexpr(2.0 ** -16)


@triton.jit
def _log(x, FAST: tl.constexpr = False):
    """fp32 natural log: the device libm's (as PyTorch's CUDA ``log``), or with ``FAST`` the GPU's ``lg2.approx`` times
    ln 2 (absolute error below 2e-7 plus rounding); NumPy's under the interpreter."""
    if _INTERPRET:
        y = tl.log(x)
    elif FAST:
        y = libdevice.fast_logf(x)
    else:
        y = libdevice.log(x)
    return y


@triton.jit
def _mix32(x):
    """The reference's ``_hash32`` ("lowbias32") on uint32 values."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _uniform(key, v):
    """The reference's noise for tokens ``v`` of the row with hash key ``key``: 24 bits as ``(k + 0.5) / 2^24``, at
    most :data:`~jetrl.rollout.sampling.U_MAX`."""
    bits = _mix32(_mix32(key ^ v.to(tl.uint32)) + key)
    return tl.minimum(((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0), U_MAX)


@triton.jit
def _gumbel_approx(u):
    """``-log(-log(u))`` to within 5e-6: ``-log(u)`` as its series in ``d = 1 - u`` (exact in fp32 for u >= 1/2)
    where u is near 1 (there a log of u would lose the digits of -log(u)), else by the fast log; both
    within 3e-6 relative, which the outer fast log turns into an absolute error."""
    d = 1.0 - u
    small = d * (1.0 + d * (0.5 + d * (0.33333334 + d * (0.25 + d * 0.2))))
    return -_log(tl.where(d < 0.0625, small, -_log(u, True)), True)


@triton.jit
def _top2(v1, i1, s1, v2, i2, s2):
    """Combine of the (best, its first index, second best) reduction: the larger value wins, the lower index at a
    tie (argmax's rule); the second best is the larger of both seconds and the loser's value."""
    first = (v1 > v2) | ((v1 == v2) & (i1 < i2))
    return (tl.where(first, v1, v2), tl.where(first, i1, i2),
            tl.maximum(tl.maximum(s1, s2), tl.where(first, v2, v1)))


@triton.jit
def _seeded_gumbel_sample_kernel(logits_ptr, stride_row, temp_ptr, seed_lo_ptr, seed_hi_ptr, index_ptr, pos_ptr,
                                 part_ptr, part_idx_ptr, V: tl.constexpr, BLOCK_V: tl.constexpr,
                                 TILES: tl.constexpr, SPLITS: tl.constexpr, EXACT_TILES: tl.constexpr):
    """Program (row, split): tiles ``split * TILES ..`` of the row -> its partials: the max and sum of
    exponentials of ``scaled`` (logsumexp in two numbers), the best score, its ``scaled`` and its index.

    A tile's winner: the exact noise (two libm logs an element) is the kernel's cost, so a sampled row's tile is
    first scored with the approximate noise (:func:`_gumbel_approx`); where the second best lies further than
    ``2^-12 + |best| * 2^-16`` below the approximate best (far above the approximation's error plus an ulp of the
    score each way; one reduction finds both), the best is the winner of the exact scores too, and only its exact
    score is computed; otherwise (near-ties, rare) the whole tile is scored exactly, as always with
    ``EXACT_TILES``. Greedy rows take the first largest logit; T = 1 skips the division."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    t = tl.load(temp_ptr + row)
    greedy = t == 0.0
    t = tl.where(greedy, 1.0, t)
    seed_lo = tl.load(seed_lo_ptr + row).to(tl.uint32)
    seed_hi = tl.load(seed_hi_ptr + row).to(tl.uint32)
    index = tl.load(index_ptr + row).to(tl.uint32)
    position = tl.load(pos_ptr + row).to(tl.uint32)
    key = _mix32(seed_lo ^ _mix32(seed_hi + 0x9E3779B9))
    key = _mix32(key ^ _mix32(index + 0x85EBCA6B))
    key = _mix32(key ^ _mix32(position + 0xC2B2AE35))

    offs = tl.arange(0, BLOCK_V)
    run_max = tl.full([1], float("-inf"), tl.float32)  # logsumexp of scaled so far: max and sum of exp(. - max)
    run_sum = tl.zeros([1], tl.float32)
    best = tl.full([1], float("-inf"), tl.float32)
    best_idx = tl.full([1], 0, tl.int32)
    best_scaled = tl.full([1], 0.0, tl.float32)
    base = logits_ptr + row.to(tl.int64) * stride_row
    for i in range(TILES):
        v0 = (split * TILES + i) * BLOCK_V
        if v0 < V:  # the last split's last tiles may lie past the vocabulary
            v = v0 + offs
            ok = v < V
            x = tl.load(base + v, mask=ok, other=float("-inf")).to(tl.float32)
            scaled = x
            if t != 1.0:
                scaled = tl.div_rn(x, tl.full([BLOCK_V], 1.0, tl.float32) * t)
            tile_max = tl.max(scaled, 0)
            new_max = tl.maximum(run_max, tile_max)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe) + tl.sum(tl.where(ok, tl.exp(scaled - safe), 0.0), 0)
            run_max = new_max
            one_candidate = row < 0  # (false, as a scalar of the type the branches below assign)
            if greedy:
                tile_best = tl.max(scaled, 0)
                tile_idx = tl.argmax(scaled, 0)  # first index of the maximum
            else:
                u = _uniform(key, v)
                approx = tl.where(ok, scaled + _gumbel_approx(u), float("-inf"))
                none = tl.full([BLOCK_V], float("-inf"), tl.float32)
                tile_best, tile_idx, second = tl.reduce((approx, offs, none), 0, _top2)
                one_candidate = second < tile_best - (NEAR_ABS + tl.abs(tile_best) * NEAR_REL)
                if EXACT_TILES or not one_candidate:
                    one_candidate = row < 0
                    score = tl.where(ok, scaled + -_log(-_log(u)), float("-inf"))
                    tile_best = tl.max(score, 0)
                    tile_idx = tl.argmax(score, 0)
            vw = v0 + tile_idx
            tile_scaled = tl.div_rn(tl.load(base + vw, mask=vw < V, other=0.0).to(tl.float32), t)  # (x / 1 is x)
            if one_candidate:  # its exact score
                tile_best = tile_scaled + -_log(-_log(_uniform(key, vw)))
            better = tile_best > best  # strictly: an earlier tile keeps ties, like argmax over the row
            best_idx = tl.where(better, vw, best_idx)
            best_scaled = tl.where(better, tile_scaled, best_scaled)
            best = tl.where(better, tile_best, best)
    one = tl.arange(0, 1)
    cell = (row * SPLITS + split) * 4
    tl.store(part_ptr + cell + one, run_max)
    tl.store(part_ptr + cell + 1 + one, run_sum)
    tl.store(part_ptr + cell + 2 + one, best)
    tl.store(part_ptr + cell + 3 + one, best_scaled)
    tl.store(part_idx_ptr + row * SPLITS + split + one, best_idx)


@triton.jit
def _merge_kernel(part_ptr, part_idx_ptr, token_ptr, logprob_ptr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program per row: the best score over the splits (the first split of a tie holds the first index) and the
    logsumexp of the splits' (max, sum) pairs."""
    row = tl.program_id(0)
    s = tl.arange(0, BLOCK_S)
    ok = s < SPLITS
    cell = (row * SPLITS + s) * 4
    run_max = tl.load(part_ptr + cell, mask=ok, other=float("-inf"))
    run_sum = tl.load(part_ptr + cell + 1, mask=ok, other=0.0)
    best = tl.load(part_ptr + cell + 2, mask=ok, other=float("-inf"))
    best_scaled = tl.load(part_ptr + cell + 3, mask=ok, other=0.0)
    best_idx = tl.load(part_idx_ptr + row * SPLITS + s, mask=ok, other=0)
    total_max = tl.max(run_max, 0)
    safe = tl.where(total_max == float("-inf"), 0.0, total_max)
    total = tl.sum(tl.where(ok, run_sum * tl.exp(run_max - safe), 0.0), 0)
    top = tl.max(best, 0)
    win = tl.min(tl.where(ok & (best == top), s, BLOCK_S), 0)
    token = tl.sum(tl.where(s == win, best_idx, 0), 0)
    scaled = tl.sum(tl.where(s == win, best_scaled, 0.0), 0)
    one = tl.arange(0, 1)
    tl.store(token_ptr + row + one, tl.full([1], 0, tl.int64) + token.to(tl.int64))
    tl.store(logprob_ptr + row + one, tl.full([1], 0.0, tl.float32) + (scaled - (safe + _log(total))))


def vocab_splits(rows: int, tiles: int, device: torch.device) -> int:
    """Programs per row: about eight per SM over the batch (a row is one program's work only when the batch alone
    fills the GPU), at most one per tile."""
    from jetrl.quant.kernels.decode_splits import sm_count

    return max(1, min(tiles, -(-8 * sm_count(device) // max(rows, 1))))


def seeded_sample(logits: torch.Tensor, temperature: torch.Tensor, seed_lo: torch.Tensor, seed_hi: torch.Tensor,
                  sample_index: torch.Tensor, position: torch.Tensor, block_v: int = 2048, splits: int | None = None,
                  exact_tiles: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B,) int64, logprobs (B,) fp32) for rows that are seeded or greedy (T = 0), no truncation. The
    logits are read as their fp32 values (16-bit logits are not widened in memory first); each row is split over
    ``splits`` programs (default :func:`vocab_splits`) whose partials one more small kernel merges.
    ``exact_tiles`` scores every element with the exact noise (the kernel's slow path; the same tokens)."""
    if logits.dim() != 2:
        raise ValueError(f"seeded_sample expects (B, V) logits, got shape {tuple(logits.shape)}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    tokens = torch.empty(b, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(b, dtype=torch.float32, device=logits.device)
    if b == 0:
        return tokens, logprobs
    block_v = min(block_v, triton.next_power_of_2(v))
    tiles = -(-v // block_v)
    splits = vocab_splits(b, tiles, logits.device) if splits is None else max(1, min(int(splits), tiles))
    per_split = -(-tiles // splits)
    splits = -(-tiles // per_split)
    part = torch.empty(b, splits, 4, dtype=torch.float32, device=logits.device)
    part_idx = torch.empty(b, splits, dtype=torch.int32, device=logits.device)
    _seeded_gumbel_sample_kernel[(b, splits)](
        logits, logits.stride(0), temperature.float().contiguous(), seed_lo.contiguous(), seed_hi.contiguous(),
        sample_index.contiguous(), position.contiguous(), part, part_idx, V=v, BLOCK_V=block_v, TILES=per_split,
        SPLITS=splits, EXACT_TILES=exact_tiles, num_warps=4, **COMPILE_OPTIONS)
    _merge_kernel[(b,)](part, part_idx, tokens, logprobs, SPLITS=splits,
                        BLOCK_S=max(2, triton.next_power_of_2(splits)), num_warps=1, **COMPILE_OPTIONS)
    return tokens, logprobs


__all__ = ["seeded_sample", "vocab_splits"]
