"""The LM head's chunked logprob/entropy autograd function and its Triton kernels.

* The function (PyTorch path) against autograd through the plain formulas on full logits: values and the
  gradients of hidden and of the head's weight, for losses on logprobs, on entropies, or on both.
* The kernels under ``TRITON_INTERPRET=1`` (a child process) against the PyTorch chunk formulas, and the
  whole function through them against the PyTorch path.
"""

from __future__ import annotations

import json

import pytest
import torch

import jetrl.models as jm
from conftest import rel_err
from interpreted import run_interpreted
from jetrl.models.logprobs import chunk_grad_reference, chunk_stats_reference


def plain(hidden, weight, targets, temperature):
    logp = torch.log_softmax(hidden.double() @ weight.double().t() / temperature, -1)
    lp = torch.where(targets >= 0, logp.gather(-1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    return lp, -(logp.exp() * logp).sum(-1)


def tiny_model(tied: bool):
    cfg = dict(model_type="llama", vocab_size=333, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=tied)
    return jm.build_model(cfg, dtype=torch.float32, seed=1)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("temperature,chunk,loss", [(1.0, 7, "both"), (0.6, 50, "logprob"), (1.7, 1000, "entropy")])
def test_function_matches_autograd_of_the_plain_formulas(gen, tied, temperature, chunk, loss):
    model = tiny_model(tied)
    n = 61
    hidden = torch.randn(n, 64, generator=gen).requires_grad_(True)
    targets = torch.randint(0, 333, (n,), generator=gen)
    targets[::9] = -1
    w_lp, w_ent = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    lp, ent = jm.logprobs_from_hidden(model, hidden, targets, temperature, chunk, impl="reference")
    ref_lp, ref_ent = plain(hidden, model.lm_head.weight, targets, temperature)
    # fp32 logits over 333 classes against fp64: a few ulps of the log-sum-exp
    assert (lp[targets < 0] == 0).all()
    assert torch.allclose(lp.double(), ref_lp, atol=2e-6, rtol=0) and torch.allclose(ent.double(), ref_ent, atol=2e-6)

    def objective(a, b):
        return {"both": (a * w_lp).sum() + (b * w_ent).sum(), "logprob": (a * w_lp).sum(),
                "entropy": (b * w_ent).sum()}[loss]

    got = torch.autograd.grad(objective(lp, ent), [hidden, model.lm_head.weight])
    want = torch.autograd.grad(objective(ref_lp, ref_ent), [hidden, model.lm_head.weight])
    for g, w in zip(got, want):
        assert torch.isfinite(g).all() and g.dtype == torch.float32
        assert rel_err(g.double(), w) < 1e-5  # fp32 chunks against fp64 autograd


def test_grad_only_where_needed_and_no_grad_path(gen):
    model = tiny_model(False)
    hidden = torch.randn(20, 64, generator=gen)
    targets = torch.randint(0, 333, (20,), generator=gen)
    model.lm_head.weight.requires_grad_(False)
    with torch.no_grad():
        lp0, ent0 = jm.logprobs_from_hidden(model, hidden, targets, 1.0, 8, impl="reference")
    assert not lp0.requires_grad
    h = hidden.clone().requires_grad_(True)
    lp, ent = jm.logprobs_from_hidden(model, h, targets, 1.0, 8, impl="reference")
    assert torch.equal(lp.detach(), lp0) and torch.equal(ent.detach(), ent0)
    lp.sum().backward()
    assert h.grad is not None and model.lm_head.weight.grad is None


def test_chunk_grad_reference_is_autograd_of_chunk_stats(gen):
    logits = torch.randn(9, 40, generator=gen, dtype=torch.float64) * 3
    targets = torch.randint(0, 40, (9,), generator=gen)
    targets[2] = -1
    g_lp, g_ent = torch.randn(9, generator=gen), torch.randn(9, generator=gen)
    x = logits.clone().requires_grad_(True)
    lp, ent, lse = chunk_stats_reference(x, targets, 0.8)  # fp32 inside: compare in fp32 terms
    (lp * g_lp).sum().add((ent * g_ent).sum()).backward()
    got = chunk_grad_reference(logits, targets, lse.detach(), ent.detach(), g_lp, g_ent, 0.8)
    assert rel_err(got, x.grad) < 1e-5


_CHILD = r'''
import json, sys
import torch
import jetrl.models as jm
from jetrl.quant.kernels import logprobs_triton as K
from jetrl.models.logprobs import chunk_grad_reference, chunk_stats_reference

g = torch.Generator().manual_seed(0)
rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())
out = {}
# vocab over several kernel blocks with a partial last one; bf16 and fp32 logits; temperatures; no-target rows
for dtype in (torch.bfloat16, torch.float32):
    for temp in (1.0, 0.7):
        rows, vocab = 5, 2 * K.STATS_BLOCK_V + 777
        logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
        targets = torch.randint(0, vocab, (rows,), generator=g)
        targets[1] = -1
        targets[3] = vocab - 1
        lp, ent, lse = K.logprob_stats(logits, targets, temp)
        r_lp, r_ent, r_lse = chunk_stats_reference(logits, targets, temp)
        g_lp, g_ent = torch.randn(rows, generator=g), torch.randn(rows, generator=g)
        grads = {}
        for name, a, b in (("both", g_lp, g_ent), ("lp", g_lp, None), ("ent", None, g_ent)):
            got = K.logprob_grad_(logits.clone(), targets, r_lse, r_ent, a, b, temp)
            want = chunk_grad_reference(logits, targets, r_lse, r_ent, a, b, temp)
            grads[name] = rel(got.float(), want.float())
        out[f"{dtype}-{temp}"] = {
            "lp": float((lp - r_lp).abs().max()), "ent": float((ent - r_ent).abs().max()),
            "lse": float((lse - r_lse).abs().max()), "lp_untargeted_zero": bool(lp[1] == 0), "grads": grads,
            "finite": bool(torch.isfinite(torch.stack([lp, ent, lse])).all())}
# the whole function through the kernels against its PyTorch path (bf16 model, tied head)
cfg = dict(model_type="qwen2", vocab_size=5000, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
           rope_theta=10000.0, tie_word_embeddings=True)
res = {}
for impl, keep in (("reference", 0), ("triton", 1 << 30), ("triton", 0)):  # logits kept, or recomputed
    model = jm.build_model(cfg, dtype=torch.bfloat16, seed=2)
    hidden = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_(True)
    targets = torch.randint(0, 5000, (37,), generator=torch.Generator().manual_seed(2))
    targets[-1] = -1
    lp, ent = jm.logprobs_from_hidden(model, hidden, targets, 0.9, 16, impl=impl, keep_logits_bytes=keep)
    (lp.sum() + 0.3 * ent.sum()).backward()
    res[impl, keep] = (lp.detach(), ent.detach(), hidden.grad.float(), model.lm_head.weight.grad.float())
out["function"] = [rel(a, b) for a, b in zip(res["triton", 1 << 30], res["reference", 0])]
try:
    jm.logprobs_from_hidden(model, hidden.detach(), torch.tensor([0] * 36 + [5000]), impl="triton")
    out["target_out_of_vocab_rejected"] = False
except ValueError as e:
    out["target_out_of_vocab_rejected"] = "vocabulary" in str(e)
out["kept_equals_recomputed"] = all(torch.equal(a, b) for a, b in zip(res["triton", 1 << 30], res["triton", 0]))
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "logprob kernels")


def test_kernels_match_the_chunk_formulas(interpreted):
    print(json.dumps(interpreted, indent=1))
    for case in ("torch.bfloat16-1.0", "torch.bfloat16-0.7", "torch.float32-1.0", "torch.float32-0.7"):
        r = interpreted[case]
        assert r["finite"] and r["lp_untargeted_zero"]
        # fp32 online log-sum-exp vs torch.logsumexp over ~9k logits of magnitude ~10: summation order only
        assert r["lp"] < 2e-5 and r["ent"] < 2e-5 and r["lse"] < 2e-5, case
        # gradients in the logits' dtype: bf16 rounding (2^-8) of values that differ in the last fp32 bits
        tol = 2e-3 if "bfloat16" in case else 1e-5
        assert all(v < tol for v in r["grads"].values()), (case, r["grads"])


def test_function_through_the_kernels_matches_its_pytorch_path(interpreted):
    assert interpreted["kept_equals_recomputed"]  # kept logits are the recomputed ones, bit for bit
    assert interpreted["target_out_of_vocab_rejected"]  # a clear error, not a read past the row
    lp, ent, d_hidden, d_weight = interpreted["function"]
    assert lp < 1e-6 and ent < 1e-6  # same bf16 logits, fp32 statistics: summation order only
    # bf16 logit gradients, then bf16 GEMMs: a few bf16 roundings apart (2^-8 relative each)
    assert d_hidden < 1e-2 and d_weight < 1e-2


def test_kept_logits_give_the_recomputed_gradients_bitwise(gen):
    """Keeping the logits for the backward (one GEMM less) changes nothing: the same logits, bit for bit."""
    model = tiny_model(False)
    hidden = torch.randn(45, 64, generator=gen)
    targets = torch.randint(0, 333, (45,), generator=gen)
    grads = {}
    for keep in (0, 1 << 30):
        model.zero_grad()
        h = hidden.clone().requires_grad_(True)
        lp, ent = jm.logprobs_from_hidden(model, h, targets, 0.9, 16, impl="reference", keep_logits_bytes=keep)
        (lp.sum() - 0.2 * ent.sum()).backward()
        grads[keep] = (lp.detach(), h.grad, model.lm_head.weight.grad.clone())
    for a, b in zip(grads[0], grads[1 << 30]):
        assert torch.isfinite(a).all() and torch.equal(a, b)
