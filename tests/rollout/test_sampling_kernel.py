"""The one-kernel seeded sampler against the tensor-op sampler (the specification).

On CPU the Triton kernel runs under ``TRITON_INTERPRET=1`` in a child process (its ``log`` is then NumPy's,
which may differ from PyTorch's by an ulp; the noise bits themselves are exact integer arithmetic); on the
GPU (``gpu`` marker) at a Llama-3 vocabulary, through :func:`jetrl.rollout.sampling.sample`'s dispatch.
"""

from __future__ import annotations

import pytest
import torch

from jetrl.rollout.sampling import SamplingBatch, SamplingParams, sample, seeded_uniform

from interpreted import run_interpreted


_CHILD = r'''
import json, sys
import torch
from jetrl.rollout.sampling import SamplingBatch, SamplingParams, sample, seeded_uniform
from jetrl.quant.kernels import sampling_triton as ST

g = torch.Generator().manual_seed(11)
out = {}
# (vocab, tile, programs per row, dtype): one program, several (the last with fewer tiles), one per tile, and
# bf16 logits read as their fp32 values
for vocab, block, splits, dtype in ((1000, 256, 3, torch.float32), (3001, 1024, 1, torch.float32),
                                    (3001, 256, 5, torch.float32), (517, 4096, None, torch.float32),
                                    (2999, 128, 24, torch.bfloat16)):
    rows = 12
    logits = (torch.randn(rows, vocab, generator=g) * 4).to(dtype)
    logits[3, 5] = logits[3, vocab - 9] = 50.0  # a greedy tie (row 3, T = 0) across programs: the first index wins
    logits[8, 300] = logits[8, 301] = 60.0  # and one inside a tile
    params = [SamplingParams(temperature=[0.0, 0.6, 1.0, 0.0, 1.7][i % 5], seed=(i * 2654435761 + 7) % 2 ** 64)
              for i in range(rows)]
    index, position = [i % 3 for i in range(rows)], [i * 13 for i in range(rows)]
    # row 10: the noise's top cell (u clamped below 1) on a token e^-60 as likely as token 7 (vocab > 1746)
    params[10], index[10], position[10] = SamplingParams(seed=55), 0, 5
    logits[10, 7], logits[10, 1746 % vocab] = 30.0, -30.0
    # row 11: near-ties between sampled tokens (T = 1): logits c - g + 4e-6 * (a permutation), so that the scores
    # lie 4e-6 apart (well above the ulps in which NumPy's log may differ from PyTorch's): a tile holds many
    # candidates within the kernel's 2^-12 margin and takes the exact path
    params[11] = SamplingParams(temperature=1.0, seed=99)
    one = SamplingBatch.build([params[11]], [index[11]], [position[11]], "cpu")
    u = seeded_uniform(one.seed_lo, one.seed_hi, one.sample_index, one.position, vocab)[0]
    logits[11] = (5.0 + torch.log(-torch.log(u)) + 4e-6 * torch.randperm(vocab, generator=g)).to(dtype)
    batch = SamplingBatch.build(params, index, position, "cpu")
    ref_tok, ref_lp = sample(logits.float(), batch)
    for exact_tiles in (False, True):
        tok, lp = ST.seeded_sample(logits, batch.temperature, batch.seed_lo, batch.seed_hi, batch.sample_index,
                                   batch.position, block_v=block, splits=splits, exact_tiles=exact_tiles)
        out[f"{vocab}/{block}/{splits}/{dtype}/{exact_tiles}"] = {
            "tokens_equal": bool(torch.equal(tok, ref_tok)), "tie_first": int(tok[3]) == 5 and int(tok[8]) == 300,
            "top_cell": vocab <= 1746 or int(tok[10]) == 7,
            "lp_max_err": float((lp - ref_lp).abs().max()), "finite": bool(torch.isfinite(lp).all())}

# the approximate noise against the exact one (NumPy's log for both here; the GPU test below uses the device's fast
# log): every u of the 2^20 cells nearest 1, where the series replaces the log, and a stride through the rest
import triton, triton.language as tl

@triton.jit
def _noise(k_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    u = tl.minimum((tl.load(k_ptr + offs).to(tl.float32) + 0.5) * (1.0 / 16777216.0), ST.U_MAX)
    tl.store(out_ptr + offs, ST._gumbel_approx(u) - -ST._log(-ST._log(u)))

ks = torch.cat([torch.arange(2 ** 24 - 2 ** 20, 2 ** 24), torch.arange(0, 2 ** 24 - 2 ** 20, 61)])
ks = torch.cat([ks, ks[: (-len(ks)) % 4096]]).to(torch.int32)  # the 24-bit noise integers k
diff = torch.empty(len(ks), dtype=torch.float32)
_noise[(len(ks) // 4096,)](ks, diff, BLOCK=4096)
out["approx_noise_max_err"] = float(diff.abs().max())
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(_CHILD, "sampler")


def _cases(interpreted):
    return {k: v for k, v in interpreted.items() if k != "approx_noise_max_err"}


def test_kernel_draws_the_reference_tokens(interpreted):
    """Both ways of scoring a tile (approximate noise with one exact candidate, and exact throughout) draw the
    tensor ops' tokens, near-ties and the noise's top cell included."""
    assert len(_cases(interpreted)) == 10
    for case, r in _cases(interpreted).items():
        assert r["tokens_equal"], f"{case}: tokens differ from the tensor-op sampler"
        assert r["tie_first"], f"{case}: a greedy tie did not pick the first index"
        assert r["top_cell"], f"{case}: the noise's top cell overrode the logits"


def test_kernel_logprobs_match_log_softmax(interpreted):
    # logsumexp over <= 3001 fp32 terms summed in another order: |error| ~ 1e-7 per term of magnitude ~10;
    # 1e-5 absolute is far below any real difference (a wrong token or temperature moves it by > 1e-2)
    for case, r in _cases(interpreted).items():
        assert r["finite"] and r["lp_max_err"] < 1e-5, (case, r)


def test_approximate_noise_is_within_its_bound(interpreted):
    # the kernel trusts the approximate winner when no other element lies within 2^-12 of it: the approximation
    # (here the series near u = 1 and fp32 rounding) must stay far inside that
    err = interpreted["approx_noise_max_err"]
    assert err == err and err < 5e-6, err


@pytest.mark.gpu
def test_gpu_approximate_noise_is_within_its_bound_at_every_u():
    """All 2^24 noise values: the device's fast log and the series against the libm noise, within 5e-6 (the kernel's
    margin for trusting one candidate is 2^-12 = 2.4e-4 plus 2^-16 of the score)."""
    import triton
    import triton.language as tl

    from jetrl.quant.kernels import sampling_triton as ST

    @triton.jit
    def noise(out_ptr, BLOCK: tl.constexpr):
        k = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        u = tl.minimum((k.to(tl.float32) + 0.5) * (1.0 / 16777216.0), ST.U_MAX)
        tl.store(out_ptr + k, ST._gumbel_approx(u) - -ST._log(-ST._log(u)))

    diff = torch.empty(2 ** 24, dtype=torch.float32, device="cuda")
    noise[(2 ** 24 // 4096,)](diff, BLOCK=4096)
    err = float(diff.abs().max())
    assert err == err and err < 5e-6, err


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


@pytest.mark.gpu
@pytest.mark.parametrize("exact_tiles", [False, True])
def test_gpu_exact_ties_and_the_top_noise_cell(exact_tiles):
    """Rows whose logits are c + log(-log(u)) (PyTorch's CUDA log, the kernel's): every score equals c to an ulp, so
    the first index of the exact maximum decides, which the kernel must find as argmax does; and the noise's top
    cell (u clamped below 1) does not override a logit 60 larger."""
    from jetrl.quant.kernels.sampling_triton import seeded_sample

    vocab = 151936
    params = [SamplingParams(temperature=1.0, seed=7000 + i) for i in range(6)] + [SamplingParams(seed=55)]
    batch = SamplingBatch.build(params, [0] * 7, [3 * i for i in range(6)] + [5], "cuda")
    u = seeded_uniform(batch.seed_lo, batch.seed_hi, batch.sample_index, batch.position, vocab)
    logits = 4.0 + torch.log(-torch.log(u))
    logits[6] = 0.0
    logits[6, 7], logits[6, 1746] = 30.0, -30.0
    ref_tok, _ = sample(logits, batch, impl="reference")
    tok, _ = seeded_sample(logits, batch.temperature, batch.seed_lo, batch.seed_hi, batch.sample_index,
                           batch.position, exact_tiles=exact_tiles)
    assert torch.equal(tok, ref_tok) and int(tok[6]) == 7


def test_dispatch_keeps_tensor_ops_on_cpu_and_for_truncation(gen):
    """CPU tensors, top-p/top-k rows and unseeded rows take the tensor-op path (its results are the
    specification checked in test_sampling.py); this only checks that dispatch does not crash there."""
    logits = torch.randn(4, 300, generator=gen)
    for params in ([SamplingParams(seed=1)] * 4, [SamplingParams(seed=1, top_p=0.9)] * 4, [SamplingParams()] * 4):
        batch = SamplingBatch.build(params, [0] * 4, [0] * 4, "cpu")
        tok, lp = sample(logits, batch)
        assert tok.shape == (4,) and torch.isfinite(lp).all()


def test_kernel_and_reference_share_the_noise_bound():
    pytest.importorskip("triton")
    from jetrl.quant.kernels import sampling_triton as ST
    from jetrl.rollout.sampling import U_MAX

    assert ST.U_MAX.value == U_MAX == 1.0 - 2.0 ** -24
