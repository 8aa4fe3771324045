"""Exact mode's LM-head log-probabilities (``jetrl.models.logprobs.exact_logprobs_from_logits``, the one function of
the rollout's sampler and the trainer) and the trainer's chunked path over it.

* The PyTorch path (CPU): bit for bit the ``log_softmax`` formula it has always been (so CPU exact runs keep their
  bits), batch-invariant (a row's bits alone and in batches of 1, 3, 17 and 300 rows), the trainer's chunked
  function equal to the sampler's on the same logits, and its hand-written gradient against autograd of the plain
  formulas, for a plain head, a tied one and one with a bias (the generic path, under checkpointing).
* The kernel (``exact_logprob_stats``) under ``TRITON_INTERPRET=1``: against the PyTorch path to fp32 rounding,
  batch-invariant bitwise, its bits unchanged by a copy of the logits (non-contiguous or 16-bit inputs), the
  trainer's chunked function through it bitwise the sampler's on the same logits, and its gradients.
"""

from __future__ import annotations

import importlib.util
import json
import re

import pytest

from jetrl.quant.kernels.tuning import COMPILE_OPTIONS
import torch

import jetrl.models as jm
from interpreted import run_interpreted
from sm90_compile import skip_without_sm90_compiler
from jetrl.models.logprobs import exact_logprobs_from_logits
from jetrl.rollout.sampling import SamplingBatch, SamplingParams, sample

BATCHES = (1, 3, 17, 300)


HEADS = ("plain", "tied", "bias")  # a head with a bias is not a plain one: the generic, checkpointed path


def _model(head: str, vocab: int = 333):
    cfg = dict(model_type="llama", vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=head == "tied")
    model = jm.build_model(cfg, dtype=torch.float32, seed=1)
    if head == "bias":
        torch.manual_seed(3)
        model.lm_head = torch.nn.Linear(64, vocab, bias=True)
    return model


def _plain(hidden, head, targets, temperature):
    bias = 0 if head.bias is None else head.bias.double()
    logp = torch.log_softmax((hidden.double() @ head.weight.double().t() + bias) / temperature, -1)
    lp = torch.where(targets >= 0, logp.gather(-1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    return lp, -(logp.exp() * logp).sum(-1)


def test_reference_is_the_log_softmax_formula_bitwise_and_batch_invariant():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 3000, generator=g) * 4
    targets = torch.randint(0, 3000, (300,), generator=g)
    targets[5] = -1
    temps = torch.rand(300, generator=g) + 0.3
    lp, ent, lse = exact_logprobs_from_logits(logits, targets, temps, impl="reference")
    logsm = (logits / temps[:, None]).log_softmax(-1)
    want = torch.where(targets >= 0, logsm.gather(-1, targets.clamp(min=0)[:, None])[:, 0], 0.0)
    assert torch.equal(lp, want) and lp[5] == 0
    assert torch.equal(ent, -(logsm.exp() * logsm).sum(-1))
    torch.testing.assert_close(lse, torch.logsumexp(logits / temps[:, None], -1))
    for b in BATCHES:
        for start in (0, 300 - b):
            rows = slice(start, start + b)
            got = exact_logprobs_from_logits(logits[rows], targets[rows], temps[rows], impl="reference")
            assert all(torch.equal(x, y[rows]) for x, y in zip(got, (lp, ent, lse))), (b, start)
    with pytest.raises(ValueError, match="temperature"):
        exact_logprobs_from_logits(logits, targets, temps[:3])


@pytest.mark.parametrize("head", HEADS)
def test_trainer_equals_sampler_bitwise_on_cpu(head):
    """The trainer's chunked exact log-probabilities are the sampler's, bit for bit, whatever the chunking."""
    model = _model(head)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(41, 64, generator=g)
    with torch.no_grad():
        logits = model.compute_logits(hidden, exact=True)
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(41)]
    batch = SamplingBatch.build(params, [0] * 41, [0] * 41, "cpu")
    tokens, engine_lp = sample(logits, batch, exact=True)
    for chunk in (None, 7, 41):
        with torch.no_grad():
            lp, _ = jm.logprobs_from_hidden(model, hidden, tokens, 0.8, chunk, exact=True)
        assert torch.equal(lp, engine_lp), chunk
        h = hidden.clone().requires_grad_(True)  # the grad-enabled path computes the same forward values
        lp_grad, _ = jm.logprobs_from_hidden(model, h, tokens, 0.8, chunk, exact=True)
        assert torch.equal(lp_grad.detach(), engine_lp), chunk


@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("temperature,chunk,loss", [(1.0, 7, "both"), (0.6, 50, "logprob"), (1.7, 1000, "entropy")])
def test_exact_gradient_matches_autograd_of_the_plain_formulas(head, temperature, chunk, loss):
    model = _model(head)
    g = torch.Generator().manual_seed(2)
    n = 61
    hidden = torch.randn(n, 64, generator=g).requires_grad_(True)
    targets = torch.randint(0, 333, (n,), generator=g)
    targets[::9] = -1
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    lp, ent = jm.logprobs_from_hidden(model, hidden, targets, temperature, chunk, exact=True)
    ref_lp, ref_ent = _plain(hidden, model.lm_head, targets, temperature)
    assert (lp[targets < 0] == 0).all()
    assert torch.allclose(lp.double(), ref_lp, atol=2e-6, rtol=0) and torch.allclose(ent.double(), ref_ent, atol=2e-6)

    def objective(a, b):
        return {"both": (a * w_lp).sum() + (b * w_ent).sum(), "logprob": (a * w_lp).sum(),
                "entropy": (b * w_ent).sum()}[loss]

    params = [hidden, model.lm_head.weight] + ([model.lm_head.bias] if head == "bias" else [])
    got = torch.autograd.grad(objective(lp, ent), params)
    want = torch.autograd.grad(objective(ref_lp, ref_ent), params)
    for a, b in zip(got, want):
        assert torch.isfinite(a).all() and a.dtype == torch.float32
        assert float((a.double() - b).norm() / b.norm()) < 1e-5  # fp32 chunks against fp64 autograd


_CHILD = r'''
import json, sys
import torch
import jetrl.models as jm
from jetrl.models.logprobs import exact_logprobs_from_logits, exact_stats_reference
from jetrl.quant.kernels import logprobs_triton as K
from jetrl.rollout.sampling import SamplingBatch, SamplingParams, sample

g = torch.Generator().manual_seed(0)
out = {}
# vocab over several kernel blocks with a partial last one; per-row temperatures; no-target rows
rows, vocab = 40, 2 * K.STATS_BLOCK_V + 777  # few rows: the interpreter runs one program per row
logits = torch.randn(rows, vocab, generator=g) * 4
targets = torch.randint(0, vocab, (rows,), generator=g)
targets[1] = -1
targets[3] = vocab - 1
temps = torch.rand(rows, generator=g) + 0.3
temps[7] = 1.0
full = exact_logprobs_from_logits(logits, targets, temps, impl="triton")
ker = K.exact_logprob_stats(logits, targets, temps)
out["dispatch_is_the_kernel"] = all(torch.equal(a, b) for a, b in zip(full, ker))
ref = exact_stats_reference(logits, targets, temps)
out["vs_reference"] = [float((a - b).abs().max()) for a, b in zip(full, ref)]
out["untargeted_zero"] = bool(full[0][1] == 0)
out["finite"] = bool(torch.isfinite(torch.stack(full)).all())
inv = []
for b in (1, 3, 17, rows):
    for start in (0, rows - b, (rows - b) // 2):
        r = slice(start, start + b)
        got = exact_logprobs_from_logits(logits[r], targets[r], temps[r], impl="triton")
        inv.append(all(torch.equal(x, y[r]) for x, y in zip(got, full)))
ends = (0, rows // 2, rows - 1)
alone = [exact_logprobs_from_logits(logits[[i]], targets[[i]], temps[[i]], impl="triton") for i in ends]
inv += [all(torch.equal(x, y[[i]]) for x, y in zip(a, full)) for a, i in zip(alone, ends)]
out["batch_invariant"] = inv
# a copy of the values changes no bit: a strided view, a bf16 input (widened exactly), a misaligned start
wide = torch.zeros(rows, vocab + 5)
wide[:, 2:vocab + 2] = logits
strided = exact_logprobs_from_logits(wide[:, 2:vocab + 2], targets, temps, impl="triton")
half = logits.to(torch.bfloat16)
from_half = exact_logprobs_from_logits(half, targets, temps, impl="triton")
from_half32 = exact_logprobs_from_logits(half.float(), targets, temps, impl="triton")
out["strided_same"] = all(torch.equal(a, b) for a, b in zip(strided, full))
out["bf16_same_as_its_fp32"] = all(torch.equal(a, b) for a, b in zip(from_half, from_half32))
# temperature 1 skips the division: the same bits as dividing logits * 2 by 2 (both exact: the same z)
at_one = K.exact_logprob_stats(logits, targets, torch.ones(rows))
at_two = K.exact_logprob_stats(logits * 2, targets, torch.full((rows,), 2.0))
out["t1_skip_is_the_division"] = all(torch.equal(a, b) for a, b in zip(at_one, at_two))
out["t1_row_in_a_mixed_launch"] = all(torch.equal(a[7], b[7]) for a, b in zip(full, at_one))
# the trainer's chunked function through the kernels == the sampler's on the same logits, bf16 and fp32 models
cfg = dict(model_type="llama", vocab_size=5000, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
           rope_theta=10000.0)
for dtype in (torch.float32, torch.bfloat16):
    for head in ("plain", "bias"):  # a plain head, and a head with a bias (the generic, checkpointed path)
        model = jm.build_model(cfg, dtype=dtype, seed=2)
        if head == "bias":
            torch.manual_seed(3)
            model.lm_head = torch.nn.Linear(64, 5000, bias=True, dtype=dtype)
        hidden = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
        with torch.no_grad():
            lg = model.compute_logits(hidden, exact=True)
        # top-k rows draw their tokens with the reference's tensor ops, not the seeded-sampling kernel (tested in
        # tests/rollout/test_sampling_kernel.py; interpreted, it took most of a minute here); the exact log-probs
        # the sampler reports still come from the kernel under test
        batch = SamplingBatch.build([SamplingParams(temperature=0.9, seed=i, top_k=4000) for i in range(37)],
                                    [0] * 37, [0] * 37, "cpu")
        tokens, engine_lp = sample(lg, batch, impl="triton", exact=True)
        same = []
        for chunk in (16, 37):
            with torch.no_grad():
                lp, _ = jm.logprobs_from_hidden(model, hidden, tokens, 0.9, chunk, impl="triton", exact=True)
            same.append(torch.equal(lp, engine_lp))
            h = hidden.clone().requires_grad_(True)
            lp, ent = jm.logprobs_from_hidden(model, h, tokens, 0.9, chunk, impl="triton", exact=True)
            same.append(torch.equal(lp.detach(), engine_lp))
            (lp.sum() + 0.3 * ent.sum()).backward()
            got = (h.grad.float(), model.lm_head.weight.grad.float())
            model.zero_grad()
            h = hidden.clone().requires_grad_(True)
            lp, ent = jm.logprobs_from_hidden(model, h, tokens, 0.9, chunk, impl="reference", exact=True)
            (lp.sum() + 0.3 * ent.sum()).backward()
            want = (h.grad.float(), model.lm_head.weight.grad.float())
            model.zero_grad()
            out[f"grad-{str(dtype)[6:]}-{head}-{chunk}"] = [
                float((a.double() - b.double()).norm() / b.double().norm()) for a, b in zip(got, want)]
        out[f"trainer_is_sampler-{str(dtype)[6:]}-{head}"] = same
json.dump(out, sys.stdout)
'''


@pytest.fixture(scope="module")
def interpreted():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton)")
    return run_interpreted(_CHILD, "exact log-prob kernel")


def test_kernel_is_the_dispatch_and_close_to_the_reference(interpreted):
    print(json.dumps(interpreted, indent=1))
    assert interpreted["dispatch_is_the_kernel"] and interpreted["untargeted_zero"] and interpreted["finite"]
    # an online log-sum-exp over ~9k fp32 logits of magnitude ~10 against log_softmax: summation order only
    assert all(v < 2e-5 for v in interpreted["vs_reference"]), interpreted["vs_reference"]


def test_kernel_is_batch_invariant_and_copies_change_no_bit(interpreted):
    assert all(interpreted["batch_invariant"]), interpreted["batch_invariant"]
    assert interpreted["strided_same"] and interpreted["bf16_same_as_its_fp32"]


def test_temperature_one_skips_the_division_bitwise(interpreted):
    """A row at temperature 1 skips the division: its bits equal those of the division path on the same values
    (logits * 2 at temperature 2: both z exact), alone and in a launch whose other rows divide."""
    assert interpreted["t1_skip_is_the_division"] and interpreted["t1_row_in_a_mixed_launch"]


def test_trainer_through_the_kernel_is_the_sampler_bitwise(interpreted):
    for key, same in interpreted.items():
        if key.startswith("trainer_is_sampler"):
            assert all(same), key


def test_kernel_gradients_match_the_reference_path(interpreted):
    for key, errs in interpreted.items():
        if key.startswith("grad-"):
            # fp32 models: summation order only; bf16: the logit gradient rounded to bf16, then bf16 GEMMs
            assert all(e < (1e-5 if "float32" in key else 1e-2) for e in errs), (key, errs)


def _compiled_ptx(xdtype: str, aligned_vocab: bool, aligned_scalars: bool = True) -> tuple[str, str]:
    """Exact mode's specialization of the statistics kernel compiled for the H200 (sm_90a) on this CPU machine:
    its register layouts (TTGIR) and its sequence of fp32 arithmetic and shuffle instructions (PTX, loads and
    widenings left out)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from jetrl.quant.kernels import logprobs_triton as K

    kernel = K._logprob_stats_kernel
    names = kernel.arg_names
    consts = dict(SCALE=True, EXACT=True, NUM_BLOCKS=32, BLOCK_V=K.STATS_BLOCK_V)
    types = {"x_ptr": f"*{xdtype}", "t_ptr": "*i64", "lp_ptr": "*fp32", "ent_ptr": "*fp32", "lse_ptr": "*fp32",
             "temp_ptr": "*fp32", "temp": "fp32"}
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    scalars = ["t_ptr", "lp_ptr", "ent_ptr", "lse_ptr", "temp_ptr"]  # per-row loads and stores: their alignment
    aligned = ["x_ptr"] + scalars * aligned_scalars + ["V", "stride_x"] * aligned_vocab  # varies with the rows
    src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=K.EXACT_NUM_WARPS, **COMPILE_OPTIONS))
    return compiled.asm["ttgir"], compiled.asm["ptx"]


def _compiled(xdtype: str, aligned_vocab: bool, aligned_scalars: bool = True) -> tuple[list[str], list[str]]:
    """Exact mode's specialization of the statistics kernel compiled for the H200 (sm_90a) on this CPU machine:
    its register layouts (TTGIR) and its sequence of fp32 arithmetic and shuffle instructions (PTX, loads and
    widenings left out)."""
    ttgir, ptx = _compiled_ptx(xdtype, aligned_vocab, aligned_scalars)
    layouts = sorted(set(re.findall(r"#ttg\.blocked<[^>]*>", ttgir)))
    ops = []
    for line in ptx.splitlines():
        op = line.strip().split(" ")[0] if line.strip() else ""
        if any(t in op for t in (".f32", "shfl", "ex2", "lg2")) and not op.startswith(("ld.", "cvt.")):
            ops.append(op)
    return layouts, ops


@pytest.mark.parametrize("aligned_vocab", [True, False], ids=["vocab%16==0", "odd-vocab"])
def test_kernel_sums_fp32_and_16bit_logits_in_one_order(aligned_vocab):
    """The sampler reads fp32 logits, the trainer's chunked head bf16 ones (the same values): the exact kernel must
    compile both to the same register layout and the same fp32 instruction sequence, i.e. the same bits."""
    skip_without_sm90_compiler()
    want = _compiled("fp32", aligned_vocab)
    assert len(want[0]) == 1 and want[1].count("ex2.approx.f32") >= 2, want
    for dtype in ("bf16", "fp16"):
        assert _compiled(dtype, aligned_vocab) == want, dtype
    # the outputs, targets and temperatures of a slice of rows start anywhere: the same arithmetic
    assert _compiled("bf16", aligned_vocab, aligned_scalars=False)[1] == want[1]


def test_kernel_branches_on_temperature_one():
    """The temperature-1 skip is compiled in, not only correct (``x / 1.0 == x`` makes a kernel that always divides
    pass the bitwise tests too): the row's temperature is compared with 1.0 (``0f3F800000``), and the vocabulary
    loop exists twice. Per thread, each copy takes one exponential per logit it holds plus one for the rescale;
    only one copy divides, one division per logit plus the target logit's. So two copies give twice as many
    exponentials as divisions, one copy as many."""
    skip_without_sm90_compiler()
    _, ptx = _compiled_ptx("bf16", True)
    assert re.search(r"setp\.(eq|neu)\.f32\s+%p\d+, %r\d+, 0f3F800000;", ptx), "no comparison with 1.0"
    divisions, exps = len(re.findall(r"\bdiv\.rn\.f32\b", ptx)), len(re.findall(r"\bex2\.approx", ptx))
    assert divisions > 1 and exps == 2 * divisions, (divisions, exps)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_temperature_one_skip_on_the_gpu(dtype):
    """On the H200 at the 8B vocabulary: a row at temperature 1 gives the division path's bits (logits * 2 at
    temperature 2), alone and inside a launch of mixed temperatures."""
    from jetrl.quant.kernels import logprobs_triton as K

    g = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 64, 128256
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    at_one = K.exact_logprob_stats(logits, targets, torch.ones(rows, device="cuda"))
    at_two = K.exact_logprob_stats(logits * 2, targets, torch.full((rows,), 2.0, device="cuda"))
    assert all(torch.equal(a, b) for a, b in zip(at_one, at_two))
    temps = torch.rand(rows, device="cuda", generator=g) + 0.3
    temps[::3] = 1.0
    mixed = K.exact_logprob_stats(logits, targets, temps)
    assert all(torch.equal(a[::3], b[::3]) for a, b in zip(mixed, at_one))
    assert all(bool(torch.isfinite(t).all()) for t in mixed)
