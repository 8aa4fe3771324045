"""One micro-batch of the update as tensors of fixed shapes: how it is packed, scored and turned into a loss.

A micro-batch of sequences runs as one packed forward (the sequences' tokens concatenated, attention block-diagonal).
Only response tokens are scored: the LM head runs on their rows alone (row ``start + p - 1 + j`` of a sequence with
``p`` prompt tokens predicts its response token ``j``), and their log-probabilities and entropies are scattered into
``(S, R)`` tensors, the layout of the losses (:mod:`jetrl.rl.losses`); unscored cells hold 0.

:func:`pack` builds the index tensors on the host. Given a :class:`MicroBatchShape` larger than the micro-batch
(:func:`bucket_shape`), it pads every size up to the shape's:

* extra token rows (id 0) form sequences of at most ``PAD_SEQUENCE`` rows of their own, and the offsets end in
  zero-length sequences, so no real row attends to a padded one;
* extra scored rows read packed row 0 and write their log-prob to a cell past the ``(S, R)`` grid, which is
  dropped;
* extra ``(S, R)`` rows are masked (the caller's mask is zero there).

So nothing padded reaches the loss, and padded rows receive no gradient: the micro-batch's loss and gradients
are those of the unpadded micro-batch, up to summation order and one difference under FP8 training: WGrad
quantizes activations per 128 tokens, and the last block that holds real tokens may also hold padded rows,
whose values then share its scale. That is what lets :mod:`jetrl.rl.update_graphs` replay one CUDA graph for
every micro-batch of a shape.

:func:`micro_batch_loss` is the loss of one micro-batch (clipped surrogate, TIS weights, KL and entropy terms)
with its metrics as one vector (:func:`stat_names`), the same function eager and captured.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import torch

from jetrl.rl.batch import RolloutBatch
from jetrl.rl.losses import aggregate, kl_penalty, masked_mean, policy_loss, truncated_is_weights

# padded token rows are cut into sequences of at most this many rows (their attention costs len^2)
PAD_SEQUENCE = 128
# the metrics of :func:`policy_loss` a micro-batch reports (the caller weights the means by the micro-batch's tokens,
# sums pg_loss and takes the extremes of ratio_max/ratio_min)
ACTOR_KEYS = ("num_tokens", "pg_loss", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl",
              "ratio_max", "ratio_min")


@dataclass(frozen=True)
class MicroBatchShape:
    """The sizes a packed micro-batch's tensors have: ``tokens`` packed rows, ``scored`` rows through the LM head,
    ``sequences`` x ``width`` cells of the loss tensors, ``offsets`` entries of the sequence offsets (sequences
    + 1, more with padding) and ``max_seqlen``, a bound of every sequence's length."""

    tokens: int
    scored: int
    sequences: int
    width: int
    offsets: int
    max_seqlen: int


def _quantum(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, n.bit_length() - 5))


def round_up(n: int, minimum: int) -> int:
    """``n`` rounded up to 16 steps per power of two (at most 1/16 more), and to a multiple of ``minimum``
    (a power of two); at least ``minimum``."""
    if n <= minimum:
        return minimum
    quantum = _quantum(n, minimum)
    return -(-n // quantum) * quantum


def bucket_shape(tokens: int, scored: int, sequences: int, width: int, longest: int) -> MicroBatchShape:
    """The padded shape a micro-batch of these sizes runs at under CUDA graphs, coarse enough that a run meets
    few of them: tokens rounded up (:func:`round_up`, whole 128-row blocks), scored rows to a multiple of an eighth
    of that (at least 16), sequences to a multiple of 32, the longest sequence to a power of two (at least
    ``PAD_SEQUENCE``); room in the offsets for the padded rows' sequences (every micro-batch of a bucket pads fewer
    rows than the bucket's rounding quantum)."""
    padded_tokens = round_up(tokens, 128)
    room = -(-_quantum(padded_tokens, 128) // PAD_SEQUENCE)
    step = max(16, padded_tokens // 8)
    padded_sequences = -(-max(sequences, 1) // 32) * 32
    return MicroBatchShape(tokens=padded_tokens, scored=max(step, -(-scored // step) * step),
                           sequences=padded_sequences, width=width, offsets=padded_sequences + room + 1,
                           max_seqlen=max(PAD_SEQUENCE, 1 << (max(longest, 1) - 1).bit_length()))


@dataclass
class PackedMicroBatch:
    """Host tensors of one micro-batch at :attr:`shape` (see the module doc): ``ids``, ``positions`` (tokens,),
    ``scored_rows`` (the packed row that predicts each scored token), ``targets`` (its id), ``cells`` (its cell
    in the flattened ``(sequences, width)`` grid; padding: one past it), ``offsets`` (the sequence offsets), all
    int64 views of one buffer (:attr:`blob`, copied to the device at once); :attr:`offsets_list` the real
    sequences' offsets for the eager forward."""

    shape: MicroBatchShape
    blob: torch.Tensor
    offsets_list: list[int]
    num_sequences: int

    def split(self, blob: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """``(ids, positions, scored_rows, targets, cells, offsets)``: views of ``blob`` (default :attr:`blob`,
        or a device copy of it)."""
        return (self.blob if blob is None else blob).split(blob_sizes(self.shape))


def blob_sizes(shape: MicroBatchShape) -> list[int]:
    """The lengths of :meth:`PackedMicroBatch.split`'s tensors, in order."""
    return [shape.tokens, shape.tokens, shape.scored, shape.scored, shape.scored, shape.offsets]


def micro_batch_sizes(batch: RolloutBatch, rows: Sequence[int]) -> tuple[int, int, int]:
    """``(tokens, scored tokens, longest sequence)`` of a micro-batch."""
    lens = [batch.tokens[s].numel() for s in rows]
    return sum(lens), sum(batch.response_lens[s] for s in rows), max(lens, default=1)


def pack(batch: RolloutBatch, rows: Sequence[int], width: int, shape: MicroBatchShape | None = None
         ) -> PackedMicroBatch:
    """Pack the sequences ``rows`` of ``batch`` (see the module doc); ``shape`` None: exactly their sizes, with
    ``width`` cells per sequence; else padded to ``shape`` (which must hold them)."""
    tokens, scored, longest = micro_batch_sizes(batch, rows)
    if any(batch.response_lens[s] > width for s in rows):
        raise ValueError(f"a response is longer than the loss width {width}")
    exact = MicroBatchShape(tokens, scored, len(rows), width, len(rows) + 1, longest)
    shape = exact if shape is None else shape
    if (tokens > shape.tokens or scored > shape.scored or len(rows) > shape.sequences or width != shape.width
            or longest > shape.max_seqlen):
        raise ValueError(f"micro-batch of {exact} does not fit the shape {shape}")
    pad = shape.tokens - tokens
    pad_lens = [min(PAD_SEQUENCE, pad - i) for i in range(0, pad, PAD_SEQUENCE)]
    lens = [batch.tokens[s].numel() for s in rows] + pad_lens
    if len(lens) + 1 > shape.offsets:
        raise ValueError(f"{len(lens)} sequences with padding do not fit {shape.offsets} offsets")
    offsets = [0, *itertools.accumulate(lens)]
    offsets_list = offsets[:len(rows) + 1]
    offsets += [shape.tokens] * (shape.offsets - len(offsets))
    ids = torch.cat([batch.tokens[s] for s in rows] + [torch.zeros(pad, dtype=torch.int64)])
    positions = torch.cat([torch.arange(n) for n in lens]) if lens else torch.zeros(0, dtype=torch.int64)
    scored_rows, targets, cells = [], [], []
    for b, s in enumerate(rows):
        p, k = batch.prompt_lens[s], batch.response_lens[s]
        j = torch.arange(k)
        scored_rows.append(offsets[b] + p - 1 + j)
        targets.append(batch.tokens[s][p:p + k])
        cells.append(b * width + j)
    extra = shape.scored - scored
    scored_rows.append(torch.zeros(extra, dtype=torch.int64))
    targets.append(torch.zeros(extra, dtype=torch.int64))
    cells.append(torch.full((extra,), shape.sequences * width, dtype=torch.int64))
    blob = torch.cat([ids, positions, *scored_rows, *targets, *cells, torch.tensor(offsets, dtype=torch.int64)])
    return PackedMicroBatch(shape, blob, offsets_list, len(rows))


def packed_logprobs(model, packed: PackedMicroBatch, blob: torch.Tensor, temperature: float, *, exact: bool = False,
                    kv_fp8: bool = False, on_device: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies (sequences, width) of the scored tokens of ``packed`` (``blob``: its tensors on the
    model's device), 0 in unscored cells. Differentiable when grad is enabled. ``on_device``: the forward reads
    nothing on the host (``forward_packed_on_device``, fast mode only), as a CUDA graph captures it; otherwise
    ``forward_packed`` over the real sequences' offsets (any device, exact mode too)."""
    from jetrl.models import logprobs_from_hidden

    s = packed.shape
    ids, positions, scored_rows, targets, cells, offsets = packed.split(blob)
    if on_device:
        hidden = model.forward_packed_on_device(ids, positions, offsets.to(torch.int32), s.max_seqlen, kv_fp8=kv_fp8)
    else:
        real = packed.offsets_list[-1]
        hidden = model.forward_packed(ids[:real], positions[:real], packed.offsets_list, exact=exact, kv_fp8=kv_fp8,
                                      check_ids=False)  # the engine's ids: inside the vocabulary
    lp, ent = logprobs_from_hidden(model, hidden[scored_rows], targets, temperature=temperature, exact=exact,
                                   check_targets=False)
    num_cells = s.sequences * s.width

    def grid(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(num_cells + 1).scatter(0, cells, values)[:num_cells].view(s.sequences, s.width)
    return grid(lp), grid(ent)


def stat_names(with_kl: bool) -> tuple[str, ...]:
    """The names of :func:`micro_batch_loss`'s statistics vector, in order."""
    return ACTOR_KEYS + ("entropy", "finite") + (("kl_ref",) if with_kl else ())


def micro_batch_loss(alg, lp: torch.Tensor, ent: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *,
                     old_logprobs: torch.Tensor | None, rollout_logprobs: torch.Tensor | None = None,
                     is_weights: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None,
                     num_tokens, num_seqs, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss of one micro-batch under ``alg`` (an :class:`~jetrl.config.schema.AlgorithmConfig`) and its
    statistics (:func:`stat_names` order) as one detached fp32 vector (one transfer for all of them).

    ``lp``, ``ent``: (S, R) from :func:`packed_logprobs`. ``old_logprobs`` None: the old log-probs are ``lp``
    itself, detached (``old_logprobs_from_update``), and the TIS weights (``alg.tis_cap``) come from them and
    ``rollout_logprobs``; otherwise ``is_weights`` are the given ones. ``ref_logprobs``: the KL penalty's
    reference. ``num_tokens``, ``num_seqs``: the mini-batch's normalisers (numbers, or 0-dim tensors under a
    CUDA graph), ``max_len`` the generation budget (``sequence-sum-norm``)."""
    # the normalisers as device scalars either way: CUDA divides by a host number as a multiplication by its
    # reciprocal, by a tensor as a division, so eager and captured runs must both take the tensor
    num_tokens, num_seqs = (c if torch.is_tensor(c) else torch.full((), float(c), device=lp.device)
                            for c in (num_tokens, num_seqs))
    norm = dict(num_tokens=num_tokens, num_seqs=num_seqs, max_len=max_len)
    if old_logprobs is None:
        old_logprobs = torch.where(mask, lp.detach().float(), torch.zeros((), device=lp.device))
        is_weights = (truncated_is_weights(old_logprobs, rollout_logprobs, mask, alg.tis_cap)
                      if alg.tis_cap is not None else None)
    loss, metrics = policy_loss(lp, old_logprobs, advantages, mask, alg.clip_low, alg.clip_high, alg.agg,
                                is_weights=is_weights, **norm)
    if alg.entropy_coef > 0:
        loss = loss - alg.entropy_coef * aggregate(ent.float(), mask, alg.agg, **norm)
    stats = [metrics[key] for key in ACTOR_KEYS] + [masked_mean(ent, mask), torch.isfinite(loss)]
    if ref_logprobs is not None:
        kl_tokens = kl_penalty(lp, ref_logprobs, mask, alg.kl_estimator)
        loss = loss + alg.kl_coef * aggregate(kl_tokens, mask, alg.agg, **norm)
        stats[-1] = torch.isfinite(loss)
        stats.append(masked_mean(kl_tokens, mask))
    return loss, torch.stack([v.detach().float().reshape(()) for v in stats])


__all__ = ["MicroBatchShape", "PackedMicroBatch", "PAD_SEQUENCE", "ACTOR_KEYS", "round_up", "bucket_shape",
           "micro_batch_sizes", "blob_sizes", "pack", "packed_logprobs", "stat_names", "micro_batch_loss"]

