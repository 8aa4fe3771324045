"""The update's micro-batch (CPU): bucket shapes, packing with and without padding, the loss with tensor
normalisers."""

import pytest
import torch

from jetrl.config import load_config
from jetrl.models import DecoderConfig, build_model
from jetrl.rl.micro_batch import (PAD_SEQUENCE, bucket_shape, micro_batch_loss, micro_batch_sizes, pack,
                                  packed_logprobs, round_up, stat_names)
from toy_rl import MODEL, ragged_batch


def test_round_up_pads_by_at_most_a_sixteenth():
    for minimum in (16, 128):
        for n in [1, 15, 16, 17, 127, 129, 1000, 4095, 4097, 15_288, 16_384, 16_385, 100_001]:
            b = round_up(n, minimum)
            assert b >= n and b % minimum == 0
            assert b - n < max(minimum, b // 16) or b == minimum


def test_bucket_shape_holds_every_micro_batch_it_is_made_for():
    for tokens in range(1, 20_000, 37):
        shape = bucket_shape(tokens, tokens // 2, 13, 64, 700)
        pad_sequences = -(-(shape.tokens - tokens) // PAD_SEQUENCE)
        assert 13 + pad_sequences + 1 <= shape.offsets
        assert shape.tokens % 128 == 0 and shape.sequences == 32 and shape.max_seqlen == 1024
        assert tokens // 2 <= shape.scored <= max(16, tokens // 2 + shape.tokens // 8)


@pytest.mark.parametrize("seed", [0, 1])
def test_padding_changes_no_real_log_prob(seed):
    """The eager forward of a padded pack scores the real cells exactly as the unpadded pack (padded scored
    rows read row 0 and land past the grid), and leaves every other cell 0."""
    torch.manual_seed(seed)
    model = build_model(DecoderConfig(**MODEL), dtype=torch.float32, seed=seed)
    batch = ragged_batch(seed)
    rows = [0, 2, 3, 5, 6]
    width = batch.mask.shape[1]
    plain = pack(batch, rows, width)
    tokens, scored, longest = micro_batch_sizes(batch, rows)
    assert plain.shape.tokens == tokens and plain.shape.scored == scored == int(batch.mask[rows].sum())
    shape = bucket_shape(tokens, scored, len(rows), width + 9, longest)
    padded = pack(batch, rows, shape.width, shape)
    assert padded.blob.numel() > plain.blob.numel()
    # the padded layout: real sequences first, then padding rows as sequences of at most PAD_SEQUENCE rows, then
    # zero-length sequences up to the shape's offsets; padded scored rows read row 0 into the cell past the grid
    ids, positions, scored_rows, targets, cells, offsets = padded.split()
    offsets = offsets.tolist()
    real = len(rows)
    assert offsets[:real + 1] == plain.offsets_list and offsets[-1] == shape.tokens
    pads = [b - a for a, b in zip(offsets[real:], offsets[real + 1:]) if b > a]
    assert sum(pads) == shape.tokens - tokens and all(n <= PAD_SEQUENCE for n in pads)
    assert all(b >= a for a, b in zip(offsets, offsets[1:]))
    for a, b in zip(offsets[real:], offsets[real + 1:]):
        assert torch.equal(positions[a:b], torch.arange(b - a)) and not ids[a:b].any()
    assert not scored_rows[scored:].any() and (cells[scored:] == shape.sequences * shape.width).all()
    assert (cells[:scored] < shape.sequences * shape.width).all() and cells[:scored].unique().numel() == scored
    lp, ent = packed_logprobs(model, plain, plain.blob, 0.7)
    lp_p, ent_p = packed_logprobs(model, padded, padded.blob, 0.7)
    assert lp.shape == (len(rows), width) and lp_p.shape == (shape.sequences, shape.width)
    m = batch.mask[rows]
    assert torch.isfinite(lp).all() and (lp[m] < 0).all()
    assert torch.equal(lp_p[:len(rows), :width], lp) and torch.equal(ent_p[:len(rows), :width], ent)
    assert not lp_p[len(rows):].any() and not lp_p[:, width:].any() and not lp[~m].any()
    # each scored cell is the log-softmax of its row's logits at the target
    ids = torch.cat([batch.tokens[s] for s in rows])
    offsets = plain.offsets_list
    hidden = model.forward_packed(ids, torch.cat([torch.arange(len(batch.tokens[s])) for s in rows]), offsets)
    logp = torch.log_softmax(model.compute_logits(hidden) / 0.7, dim=-1)
    b, s = 1, rows[1]
    p, k = batch.prompt_lens[s], batch.response_lens[s]
    want = logp[offsets[b] + p - 1 + torch.arange(k), batch.tokens[s][p:p + k]]
    torch.testing.assert_close(lp[b, :k], want, rtol=1e-5, atol=1e-5)


def test_pack_rejects_a_shape_too_small():
    batch = ragged_batch(3)
    rows = [0, 1, 2]
    tokens, scored, longest = micro_batch_sizes(batch, rows)
    shape = bucket_shape(tokens, scored, 3, batch.mask.shape[1], longest)
    with pytest.raises(ValueError, match="does not fit"):
        pack(batch, rows + [3, 4, 5, 6], shape.width, shape)
    with pytest.raises(ValueError, match="longer than the loss width"):
        pack(batch, rows, 3)


@pytest.mark.parametrize("agg", ["token", "sequence", "sequence-sum-norm"])
def test_aggregate_takes_tensor_normalisers(agg):
    """A CUDA graph reads the mini-batch's normalisers from 0-dim tensors: :func:`aggregate` takes them (no host
    read) and gives the value and gradient of the same numbers, clamped to at least 1 alike."""
    from jetrl.rl.losses import aggregate

    gen = torch.Generator().manual_seed(4)
    mask = torch.rand(6, 11, generator=gen) < 0.7
    values = torch.randn(6, 11, generator=gen)
    for counts in ((57, 9), (0, 0)):
        out = []
        for tokens, seqs in (counts, tuple(torch.tensor(float(c)) for c in counts)):
            v = values.clone().requires_grad_(True)
            loss = aggregate(v, mask, agg, num_tokens=tokens, num_seqs=seqs, max_len=16)
            loss.backward()
            out.append((loss.detach(), v.grad))
        torch.testing.assert_close(out[0], out[1], rtol=1e-6, atol=0)


@pytest.mark.parametrize("kl", [False, True])
def test_micro_batch_loss_statistics(kl):
    """The statistics vector in :func:`stat_names` order: the policy loss's metrics, the entropy's masked mean,
    whether the loss (with its KL term) is finite, and the KL's masked mean."""
    from jetrl.rl.losses import kl_penalty, masked_mean, policy_loss

    alg = load_config(None, ["--algorithm.entropy_coef=0.01", "--algorithm.kl_coef=0.1"]).algorithm
    gen = torch.Generator().manual_seed(6)
    mask = torch.rand(6, 11, generator=gen) < 0.7
    lp = -torch.rand(6, 11, generator=gen)
    ent, adv = torch.rand(6, 11, generator=gen), torch.randn(6, generator=gen)
    old = lp + 0.05 * torch.randn(6, 11, generator=gen)
    ref = lp + 0.1 * torch.randn(6, 11, generator=gen)
    _, stats = micro_batch_loss(alg, lp, ent, mask, adv, old_logprobs=old, ref_logprobs=ref if kl else None,
                                num_tokens=57, num_seqs=9, max_len=16)
    v = dict(zip(stat_names(kl), stats.tolist()))
    assert len(v) == stats.numel()
    _, metrics = policy_loss(lp, old, adv, mask, alg.clip_low, alg.clip_high, num_tokens=57)
    assert v["pg_loss"] == pytest.approx(float(metrics["pg_loss"]), rel=1e-6)
    assert v["num_tokens"] == float(mask.sum()) and v["finite"] == 1.0
    assert v["entropy"] == pytest.approx(float(masked_mean(ent, mask)), rel=1e-6)
    if kl:
        assert v["kl_ref"] == pytest.approx(float(masked_mean(kl_penalty(lp, ref, mask), mask)), rel=1e-6)


def test_old_logprobs_from_the_micro_batch_itself():
    """``old_logprobs`` None: the ratio is 1 on every token, and the TIS weights come from ``rollout_logprobs``:
    the loss is the policy loss with ``truncated_is_weights(lp, rollout)`` as weights, not the unweighted one."""
    from jetrl.rl.losses import policy_loss, truncated_is_weights

    alg = load_config(None, ["--algorithm.tis_cap=1.5"]).algorithm
    gen = torch.Generator().manual_seed(5)
    mask = torch.rand(4, 9, generator=gen) < 0.8
    lp = (-torch.rand(4, 9, generator=gen)).requires_grad_(True)
    rollout = lp.detach() - 0.5 * torch.rand(4, 9, generator=gen)
    adv = torch.randn(4, generator=gen)
    loss, stats = micro_batch_loss(alg, lp, torch.zeros(4, 9), mask, adv, old_logprobs=None, rollout_logprobs=rollout,
                                   num_tokens=20, num_seqs=4, max_len=9)
    v = dict(zip(stat_names(False), stats.tolist()))
    assert v["ratio_max"] == v["ratio_min"] == 1.0 and v["clip_frac"] == 0.0
    assert v["num_tokens"] == float(mask.sum()) and v["finite"] == 1.0
    old = torch.where(mask, lp.detach(), torch.zeros(()))
    weights = truncated_is_weights(old, rollout, mask, 1.5)
    weighted, _ = policy_loss(lp, old, adv, mask, is_weights=weights, num_tokens=20)
    plain, _ = policy_loss(lp, old, adv, mask, num_tokens=20)
    assert torch.equal(loss, weighted) and not torch.equal(loss, plain)


@pytest.mark.parametrize("budget", [60, 97, 400])
def test_token_budget_micro_batches_are_balanced(budget):
    """Packed by token count: every row once, in its order within a micro-batch, each micro-batch within the
    budget, as few as the lower bound where that fits, and token counts close to each other."""
    from types import SimpleNamespace

    from jetrl.rl.trainer import Trainer

    batch = ragged_batch(8, num=23, width=23, max_prompt=30)
    rows = list(range(0, 23, 2)) + list(range(1, 23, 2))
    fake = SimpleNamespace(config=load_config(None, [f"--algorithm.max_tokens_per_micro_batch={budget}",
                                                     "--data.max_prompt_tokens=30", "--rollout.max_tokens=23"]))
    micros = Trainer.micro_batches(fake, batch, rows)
    lens = {s: batch.tokens[s].numel() for s in rows}
    assert sorted(s for m in micros for s in m) == sorted(rows)
    position = {s: i for i, s in enumerate(rows)}
    for m in micros:
        assert [position[s] for s in m] == sorted(position[s] for s in m)
        assert sum(lens[s] for s in m) <= budget
    counts = [sum(lens[s] for s in m) for m in micros]
    assert len(micros) >= -(-sum(lens.values()) // budget)
    if len(micros) > 1:
        assert max(counts) - min(counts) <= max(lens.values())
