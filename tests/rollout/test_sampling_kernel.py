"""The one-kernel seeded sampler against the tensor-op sampler (the specification).

On CPU the Triton kernel runs under ``TRITON_INTERPRET=1`` in a child process (its ``log`` is then NumPy's,
which may differ from PyTorch's by an ulp; the noise bits themselves are exact integer arithmetic); on the
GPU (``gpu`` marker) at a Llama-3 vocabulary, through :func:`jetrl.rollout.sampling.sample`'s dispatch.
"""

from __future__ import annotations

import pytest
import torch

from jetrl.rollout.sampling import SamplingBatch, SamplingParams, sample

from interpreted import run_interpreted


_CHILD = r'''
import json, sys
import torch
from jetrl.rollout.sampling import SamplingBatch, SamplingParams, sample
from jetrl.quant.kernels import sampling_triton as ST

g = torch.Generator().manual_seed(11)
out = {}
# (vocab, tile, programs per row, dtype): one program, several (the last with fewer tiles), one per tile, and
# bf16 logits read as their fp32 values
for vocab, block, splits, dtype in ((1000, 256, 3, torch.float32), (3001, 1024, 1, torch.float32),
                                    (3001, 256, 5, torch.float32), (517, 4096, None, torch.float32),
                                    (2999, 128, 24, torch.bfloat16)):
    rows = 10
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    logits[3, 5] = logits[3, vocab - 9] = 50.0  # a greedy tie (row 3, T = 0) across programs: the first index wins
    logits[8, 300] = logits[8, 301] = 60.0  # and one inside a tile
    params = [SamplingParams(temperature=[0.0, 0.6, 1.0, 0.0, 1.7][i % 5], seed=(i * 2654435761 + 7) % 2 ** 64)
              for i in range(rows)]
    batch = SamplingBatch.build(params, [i % 3 for i in range(rows)], [i * 13 for i in range(rows)], "cpu")
    ref_tok, ref_lp = sample(logits.float(), batch)
    tok, lp = ST.seeded_sample(logits, batch.temperature, batch.seed_lo, batch.seed_hi, batch.sample_index,
                               batch.position, block_v=block, splits=splits)
    out[f"{vocab}/{block}/{splits}/{dtype}"] = {
        "tokens_equal": bool(torch.equal(tok, ref_tok)), "tie_first": int(tok[3]) == 5 and int(tok[8]) == 300,
        "lp_max_err": float((lp - ref_lp).abs().max()), "finite": bool(torch.isfinite(lp).all())}
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "sampler")


def test_kernel_draws_the_reference_tokens(interpreted):
    assert len(interpreted) == 5
    for vocab, r in interpreted.items():
        assert r["tokens_equal"], f"vocab {vocab}: tokens differ from the tensor-op sampler"
        assert r["tie_first"], f"vocab {vocab}: a greedy tie did not pick the first index"


def test_kernel_logprobs_match_log_softmax(interpreted):
    # logsumexp over <= 3001 fp32 terms summed in another order: |error| ~ 1e-7 per term of magnitude ~10;
    # 1e-5 absolute is far below any real difference (a wrong token or temperature moves it by > 1e-2)
    for vocab, r in interpreted.items():
        assert r["finite"] and r["lp_max_err"] < 1e-5, (vocab, r)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 128256), (64, 151936), (256, 151936), (37, 49152), (256, 32000)])
def test_gpu_dispatch_equals_tensor_ops(rows, vocab, dtype):
    """The kernel (each row over several programs) draws the tensor ops' tokens at vocabularies of 32K-152K, from
    fp32 logits and from bf16 ones (read as their fp32 values; the tensor ops widen them first)."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=g, device="cuda") * 3).to(dtype)
    params = [SamplingParams(temperature=[0.0, 1.0, 0.8][i % 3], seed=1000 + i) for i in range(rows)]
    batch = SamplingBatch.build(params, [i % 4 for i in range(rows)], [7 * i for i in range(rows)], "cuda")
    tok, lp = sample(logits, batch)  # the kernel
    ref_tok, ref_lp = sample(logits.float(), batch, impl="reference")  # the tensor ops
    assert torch.equal(tok, ref_tok)
    # fp32 logsumexp over 128K terms in two summation orders: 1e-4 absolute (values ~ -12)
    assert torch.isfinite(lp).all() and float((lp - ref_lp).abs().max()) < 1e-4


def test_dispatch_keeps_tensor_ops_on_cpu_and_for_truncation(gen):
    """CPU tensors, top-p/top-k rows and unseeded rows take the tensor-op path (its results are the
    specification checked in test_sampling.py); this only checks that dispatch does not crash there."""
    logits = torch.randn(4, 300, generator=gen)
    for params in ([SamplingParams(seed=1)] * 4, [SamplingParams(seed=1, top_p=0.9)] * 4, [SamplingParams()] * 4):
        batch = SamplingBatch.build(params, [0] * 4, [0] * 4, "cpu")
        tok, lp = sample(logits, batch)
        assert tok.shape == (4,) and torch.isfinite(lp).all()
