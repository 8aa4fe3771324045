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
@pytest.mark.parametrize("kl", [False, True])
def test_tensor_normalisers_give_the_same_bits(agg, kl):
    """A CUDA graph reads the mini-batch's normalisers from 0-dim tensors: the loss, its gradient and the
    statistics are bitwise those with Python numbers."""
    alg = load_config(None, [f"--algorithm.agg={agg}", "--algorithm.entropy_coef=0.01", "--algorithm.kl_coef=0.1",
                             "--algorithm.tis_cap=2.0"]).algorithm
    gen = torch.Generator().manual_seed(4)
    mask = torch.rand(6, 11, generator=gen) < 0.7
    lp0 = -torch.rand(6, 11, generator=gen)
    ent = torch.rand(6, 11, generator=gen)
    old = lp0 + 0.05 * torch.randn(6, 11, generator=gen)
    adv = torch.randn(6, generator=gen)
    ref = lp0 + 0.1 * torch.randn(6, 11, generator=gen)
    out = []
    for counts in ((57, 9), (torch.tensor(57.0), torch.tensor(9.0))):
        lp = lp0.clone().requires_grad_(True)
        loss, stats = micro_batch_loss(alg, lp, ent, mask, adv, old_logprobs=old, is_weights=None,
                                       ref_logprobs=ref if kl else None, num_tokens=counts[0], num_seqs=counts[1],
                                       max_len=16)
        loss.backward()
        out.append((loss.detach(), lp.grad, stats))
        assert stats.shape == (len(stat_names(kl)),) and torch.isfinite(stats).all()
    for a, b in zip(*out):
        assert torch.equal(a, b)


def test_old_logprobs_from_the_micro_batch_itself():
    """``old_logprobs`` None: the ratio is 1 on every token, and TIS weights come from ``rollout_logprobs``."""
    alg = load_config(None, ["--algorithm.tis_cap=1.5"]).algorithm
    gen = torch.Generator().manual_seed(5)
    mask = torch.rand(4, 9, generator=gen) < 0.8
    lp = (-torch.rand(4, 9, generator=gen)).requires_grad_(True)
    rollout = lp.detach() - 0.2
    loss, stats = micro_batch_loss(alg, lp, torch.zeros(4, 9), mask, torch.randn(4, generator=gen),
                                   old_logprobs=None, rollout_logprobs=rollout, num_tokens=20, num_seqs=4, max_len=9)
    v = dict(zip(stat_names(False), stats.tolist()))
    assert v["ratio_max"] == v["ratio_min"] == 1.0 and v["clip_frac"] == 0.0
    assert v["num_tokens"] == float(mask.sum()) and v["finite"] == 1.0
