"""Exact on-policy mode on CPU (reference backend): the engine's log-probabilities equal the training
forward's bit for bit, whatever the batch; the batch-invariance of every op it rests on; config and errors."""

import math

import pytest
import torch

from jetrl.config import ConfigError, load_config
from jetrl.models import DecoderConfig, build_model
from jetrl.models.attention import (
    PagedAttentionMetadata,
    exact_attention_reference,
    exact_varlen_attention,
    paged_attention_reference,
    varlen_attention,
)
from jetrl.quant import ACT, quantize_tensor
from jetrl.quant.exact import EXACT_KV_CHUNK, EXACT_ROW_CHUNK, exact_fp8_gemm, exact_linear, row_invariant_matmul
from jetrl.quant.formats import WEIGHT
from jetrl.quant.norm import rms_norm
from jetrl.quant.swiglu import swiglu
from jetrl.rollout import RolloutEngine, SamplingParams
from trainer_scoring import trainer_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest (tests/conftest.py)

# Qwen3-shaped (q/k norms, GQA), hidden 128 so the FP8 blocks are whole; prompts up to 70 tokens so that
# attention crosses its 64-position chunks
CONFIG = dict(model_type="qwen3", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128, eos_token_id=1)
# (recipe, dtype, FP8 KV cache): under jet + kv_fp8 the engine reads an FP8 cache and the trainer fake-quantizes
# K/V, and the two must still agree bitwise
CASES = [("bf16", torch.float32, False), ("bf16", torch.bfloat16, False), ("jet", torch.bfloat16, False),
         ("jet", torch.bfloat16, True)]


def _prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 71, (count,), generator=g).tolist()
    return [torch.randint(2, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def models():
    return {(r, d): build_model(DecoderConfig(**CONFIG), dtype=d, recipe=r, seed=0) for r, d, _ in CASES}


def _score(model, prompts, completions, micro: int | None = None, kv_fp8: bool = False) -> list[torch.Tensor]:
    """The trainer's view in exact mode (tests/trainer_scoring.py)."""
    return trainer_logprobs(model, prompts, completions, micro=micro, kv_fp8=kv_fp8)


@pytest.mark.parametrize("recipe,dtype,kv_fp8", CASES,
                         ids=[f"{r}-{str(d)[6:]}{'-kv8' if kv else ''}" for r, d, kv in CASES])
@pytest.mark.parametrize("num_prompts,n,num_blocks", [(1, 1, 64), (1, 3, 64), (17, 1, 20)],
                         ids=["1seq", "3seq-prefix-sharing", "17seq-preempted"])
def test_engine_logprobs_equal_training_forward_bitwise(models, recipe, dtype, kv_fp8, num_prompts, n, num_blocks):
    model = models[(recipe, dtype)]
    prompts = _prompts(num_prompts, seed=num_prompts)
    engine = RolloutEngine(model, max_num_seqs=8, num_blocks=num_blocks, block_size=4, max_num_batched_tokens=48,
                           progress=False, exact=True, kv_fp8=kv_fp8)
    assert engine.runner.allocate_kv_cache() and engine.runner.kv_cache.is_fp8 == kv_fp8
    max_tokens = 6 if num_prompts > 1 else 12
    outs = engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=7,
                                                   ignore_eos=True))
    if num_prompts == 17:
        assert engine.last_stats["preemptions"] > 0  # the tiny pool forces recomputation
    for micro in (None, 2):  # one packed batch, and micro-batches of 2 sequences
        for c, lp in zip(outs, _score(model, prompts, outs, micro, kv_fp8)):
            engine_lp = torch.tensor(c.logprobs, dtype=torch.float32)
            assert torch.equal(engine_lp, lp), (recipe, dtype, micro, (engine_lp - lp).abs().max())
    if kv_fp8:  # the FP8 K/V change the values: the trainer without them is no longer bitwise the engine
        plain = _score(model, prompts, outs, None, False)
        assert any(not torch.equal(torch.tensor(c.logprobs), lp) for c, lp in zip(outs, plain))


def test_fast_mode_is_not_exact_but_exact_mode_is(models):
    """The same model and prompts: fast mode's engine/trainer gap is non-zero here (so the exact test above can
    tell the modes apart), exact mode's is zero."""
    model = models[("jet", torch.bfloat16)]
    prompts = _prompts(5, seed=11)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1, ignore_eos=True)
    gaps = {}
    for exact in (False, True):
        engine = RolloutEngine(model, max_num_seqs=8, num_blocks=64, block_size=4, progress=False, exact=exact)
        outs = engine.generate(prompts, params)
        gaps[exact] = max(float((lp - torch.tensor(c.logprobs)).abs().max())
                          for c, lp in zip(outs, trainer_logprobs(model, prompts, outs, exact=exact)))
    assert gaps[True] == 0.0 and gaps[False] > 0.0, gaps


# ------------------------------------------------------------------ the ops, one by one


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_invariant_matmul_rows_do_not_depend_on_the_batch(dtype):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 160, generator=g).to(dtype)
    x = torch.randn(3 * EXACT_ROW_CHUNK + 5, 160, generator=g).to(dtype)
    full = row_invariant_matmul(x, w)
    torch.testing.assert_close(full.float(), (x.float() @ w.float().t()), rtol=2e-2, atol=2e-2)
    for rows in ([0], [7, 3], list(range(100, 117)), list(range(x.shape[0] - 1, -1, -1))):
        assert torch.equal(row_invariant_matmul(x[rows], w), full[rows]), rows
    # the autograd wrapper: same forward, ordinary gradients
    xr, wr = x.float().clone().requires_grad_(), w.float().clone().requires_grad_()
    y = exact_linear(xr, wr)
    y.square().sum().backward()
    xr2, wr2 = x.float().clone().requires_grad_(), w.float().clone().requires_grad_()
    torch.nn.functional.linear(xr2, wr2).square().sum().backward()
    torch.testing.assert_close(xr.grad, xr2.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(wr.grad, wr2.grad, rtol=1e-4, atol=1e-4)


def test_exact_fp8_gemm_rows_do_not_depend_on_the_batch():
    g = torch.Generator().manual_seed(1)
    w = quantize_tensor(torch.randn(256, 384, generator=g), WEIGHT)
    x = torch.randn(150, 384, generator=g).to(torch.bfloat16)
    qx = quantize_tensor(x, ACT)
    full = exact_fp8_gemm(qx, w)
    for rows in ([5], [149, 0, 77], list(range(64, 131))):
        sub = quantize_tensor(x[rows], ACT)  # 1x128 quantization is per row: the same bytes
        assert torch.equal(sub.data.view(torch.uint8), qx.data[rows].view(torch.uint8))
        assert torch.equal(exact_fp8_gemm(sub, w), full[rows])
    torch.testing.assert_close(full.float(), qx.dequantize() @ w.dequantize().t(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_wise_ops_are_batch_invariant(dtype):
    """RMSNorm with the residual add and its FP8 output, SwiGLU with its FP8 output, and the 1x128
    quantization: a row's bits do not depend on the other rows (reference implementations)."""
    from jetrl.models.rope import apply_rope_qk

    g = torch.Generator().manual_seed(2)
    x, r = (torch.randn(200, 256, generator=g).to(dtype) for _ in range(2))
    w = torch.rand(256, generator=g).to(dtype) + 0.5
    gate, up = (torch.randn(200, 384, generator=g).to(dtype) for _ in range(2))
    q, k = torch.randn(200, 4, 32, generator=g).to(dtype), torch.randn(200, 2, 32, generator=g).to(dtype)
    cos, sin = torch.randn(200, 32, generator=g).to(dtype), torch.randn(200, 32, generator=g).to(dtype)
    full_norm = rms_norm(x, w, 1e-6, r, quantize=True)
    full_act, full_fp8 = swiglu(gate, up, quantize=True)
    full_q, full_k = apply_rope_qk(q, k, cos, sin)
    for rows in ([0], [199, 3], list(range(50, 67))):
        norm = rms_norm(x[rows], w, 1e-6, r[rows], quantize=True)
        assert torch.equal(norm.out, full_norm.out[rows]) and torch.equal(norm.residual, full_norm.residual[rows])
        assert torch.equal(norm.out_fp8.scale, full_norm.out_fp8.scale[rows])
        act, fp8 = swiglu(gate[rows], up[rows], quantize=True)
        assert torch.equal(act, full_act[rows]) and torch.equal(fp8.scale, full_fp8.scale[rows])
        assert torch.equal(fp8.data.view(torch.uint8), full_fp8.data[rows].view(torch.uint8))
        rq, rk = apply_rope_qk(q[rows], k[rows], cos[rows], sin[rows])
        assert torch.equal(rq, full_q[rows]) and torch.equal(rk, full_k[rows])


def test_exact_logprobs_are_batch_invariant():
    from jetrl.models.logprobs import exact_logprobs_from_logits

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(40, 5000, generator=g) * 4
    targets = torch.randint(0, 5000, (40,), generator=g)
    temps = torch.full((40,), 0.7)
    full = exact_logprobs_from_logits(logits, targets, temps)[0]
    for rows in ([0], [39, 2], list(range(10, 27))):
        assert torch.equal(exact_logprobs_from_logits(logits[rows], targets[rows], temps[rows])[0], full[rows])
    torch.testing.assert_close(full, torch.log_softmax(logits / 0.7, -1).gather(-1, targets[:, None])[:, 0])


def _paged(k_all, v_all, seqs, block_size, width, rng):
    """Scatter each sequence's K/V (L, Hkv, D) into shuffled blocks of a pool; its block table rows."""
    num_blocks = sum(-(-len(s) // block_size) for s in seqs) + 3
    perm = torch.randperm(num_blocks, generator=rng).tolist()
    kc = torch.zeros(num_blocks, block_size, *k_all.shape[1:], dtype=k_all.dtype)
    vc = torch.zeros_like(kc)
    tables = torch.full((len(seqs), width), -1, dtype=torch.int32)
    for s, rows in enumerate(seqs):
        for j, row in enumerate(rows):
            if j % block_size == 0:
                tables[s, j // block_size] = perm.pop()
            kc[tables[s, j // block_size], j % block_size] = k_all[row]
            vc[tables[s, j // block_size], j % block_size] = v_all[row]
    return kc, vc, tables


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_attention_one_function_for_packed_prefill_and_decode(dtype):
    """The packed training forward, a chunked prefill and decode steps over paged caches of different block
    sizes and table widths give the same bits for the same token; and the values are attention's."""
    rng = torch.Generator().manual_seed(4)
    lengths = [1, 5, EXACT_KV_CHUNK + 9, 2 * EXACT_KV_CHUNK + 1]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    total = cu[-1]
    q = torch.randn(total, 4, 16, generator=rng).to(dtype)
    k = torch.randn(total, 2, 16, generator=rng).to(dtype)
    v = torch.randn(total, 2, 16, generator=rng).to(dtype)
    packed = exact_varlen_attention(q, k, v, cu, 0.25)
    torch.testing.assert_close(packed.float(), varlen_attention(q, k, v, cu, 0.25).float(), rtol=2e-2, atol=2e-2)
    seqs = [list(range(cu[i], cu[i + 1])) for i in range(len(lengths))]
    for block_size, extra_width in ((4, 0), (16, 3)):
        width = -(-max(lengths) // block_size) + extra_width
        kc, vc, tables = _paged(k, v, seqs, block_size, width, rng)
        # decode: the last token of each sequence alone
        meta = PagedAttentionMetadata(torch.arange(len(lengths) + 1, dtype=torch.int32),
                                      torch.tensor(lengths, dtype=torch.int32), tables,
                                      torch.zeros(len(lengths), dtype=torch.long), 1, max(lengths))
        last = torch.tensor([c - 1 for c in cu[1:]])
        out = exact_attention_reference(q[last], kc, vc, meta, 0.25)
        assert torch.equal(out, packed[last]), block_size
        # a prefill chunk: the last 3 tokens of the two longest sequences
        rows = seqs[2][-3:] + seqs[3][-3:]
        meta = PagedAttentionMetadata(torch.tensor([0, 3, 6], dtype=torch.int32),
                                      torch.tensor(lengths[2:], dtype=torch.int32), tables[2:],
                                      torch.zeros(6, dtype=torch.long), 3, max(lengths))
        out = exact_attention_reference(q[rows], kc, vc, meta, 0.25)
        assert torch.equal(out, packed[rows]), block_size
        ref = paged_attention_reference(q[rows], kc, vc, meta, 0.25)
        torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_exact_varlen_attention_gradient_is_sdpa_s():
    g = torch.Generator().manual_seed(5)
    cu = [0, 3, 70]
    q, k, v = (torch.randn(70, h, 16, generator=g, requires_grad=True) for h in (4, 2, 2))
    exact_varlen_attention(q, k, v, cu, 0.25).square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    varlen_attention(q, k, v, cu, 0.25).square().sum().backward()
    for a, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(a, t.grad, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ the RL step, config, errors


class _Prompts:
    """Prompts of mixed lengths (2 to 40 tokens) for the RL step."""

    def __init__(self, per_step: int) -> None:
        self.per_step, self.pos = per_step, 0

    def next_batch(self):
        from jetrl.rl.trainer import PromptItem

        items = [PromptItem(_prompts(1, seed=self.pos + i)[0][:2 + 19 * i], "") for i in range(self.per_step)]
        self.pos += self.per_step
        return items


def _decode(ids):
    return ",".join(map(str, ids))


def _reward(texts, references):
    return [sum(int(t) < 128 for t in x.split(",")) / len(x.split(",")) if x else 0.0 for x in texts]


def _trainer(recipe: str, dtype, extra=()):
    from jetrl.rl.trainer import Trainer

    cfg = load_config(None, [f"--recipe={recipe}", "--exact=true", "--data.prompts_per_step=3", "--rollout.n=3",
                             "--rollout.max_tokens=8", "--algorithm.micro_batch_size=3", *extra])
    model = build_model(DecoderConfig(**CONFIG), dtype=dtype, recipe=recipe, seed=0)
    engine = RolloutEngine(model, max_num_seqs=4, num_blocks=64, block_size=4, progress=False, exact=cfg.exact)
    return Trainer(cfg, model, engine, _Prompts(3), _reward, _decode)


@pytest.mark.parametrize("recipe,dtype,extra", [
    ("bf16", torch.float32, ()), ("jet", torch.bfloat16, ()),
    ("jet", torch.bfloat16, ("--algorithm.old_logprobs_from_update=true",))],
                         ids=["bf16-fp32", "jet-bf16", "jet-bf16-old-from-update"])
def test_rl_step_mismatch_is_zero(recipe, dtype, extra):
    trainer = _trainer(recipe, dtype, extra)
    metrics = trainer.step()
    assert metrics["mismatch/logp_abs_diff_max"] == 0.0, metrics["mismatch/logp_abs_diff_max"]
    assert math.isfinite(metrics["actor/pg_loss"])


def _weights(model) -> list[torch.Tensor]:
    """Every parameter's values, from the state dict (jet's FP8 linears hold theirs in the optimizer's masters)."""
    state = model.state_dict()
    return [state[name].clone() for name, _ in model.named_parameters()]


@pytest.mark.parametrize("recipe,dtype,shape", [
    ("bf16", torch.float32, (5, 3, 15, 5)), ("bf16", torch.float32, (3, 3, 3, 3)), ("bf16", torch.bfloat16, (7, 3, 21, 3)),
    ("jet", torch.float32, (3, 3, 3, 3)), ("jet", torch.bfloat16, (5, 3, 15, 5))],
    ids=lambda v: str(v).replace("torch.", "") if not isinstance(v, tuple) else "P{}-n{}-mini{}-micro{}".format(*v))
def test_exact_over_several_steps(recipe, dtype, shape):
    """Exact mode stays exact after the weights moved: zero mismatch at every step, for every recipe and dtype,
    with batch shapes that are not powers of two (one or several optimizer steps per RL step)."""
    num_prompts, n, mini, micro = shape
    trainer = _trainer(recipe, dtype, (f"--data.prompts_per_step={num_prompts}", f"--rollout.n={n}",
                                       f"--algorithm.mini_batch_size={mini}", f"--algorithm.micro_batch_size={micro}",
                                       "--optim.lr=1e-2"))
    trainer.prompts = _Prompts(num_prompts)
    before = _weights(trainer.model)
    for step in range(3):
        metrics = trainer.step()
        assert metrics["mismatch/logp_abs_diff_max"] == 0.0, (step, metrics["mismatch/logp_abs_diff_max"])
        assert metrics["actor/num_updates"] == (num_prompts * n) // mini
    after = _weights(trainer.model)
    assert all(torch.isfinite(b.float()).all() and not torch.equal(a, b) for a, b in zip(before, after))  # moved


@pytest.mark.parametrize("minis", [1, 3], ids=["one-mini-batch", "three-mini-batches"])
def test_exact_bypass_skips_the_old_logprob_pass_and_updates_the_same(minis):
    """Exact mode with ``use_rollout_logprobs``: the engine's log-probs are the trainer's bit for bit, so the
    old_logprob pass is skipped. The update takes the same old log-probs (the same bits), so the weights after two
    steps are bitwise those of a run with the pass; the mismatch check runs on the first mini-batch's tokens (its
    forwards precede the first optimizer step) and is zero."""
    extra = ("--algorithm.kl_coef=0.1", "--algorithm.tis_cap=2.0", f"--algorithm.mini_batch_size={9 // minis}")
    runs = {}
    for bypass in (False, True):
        torch.manual_seed(0)
        trainer = _trainer("jet", torch.bfloat16, (*extra, f"--algorithm.use_rollout_logprobs={bypass}"))
        steps = [trainer.step() for _ in range(2)]
        runs[bypass] = (steps, _weights(trainer.model))
    (with_pass, w_pass), (bypassed, w_bypass) = runs[False], runs[True]
    for a, b in zip(w_pass, w_bypass):
        assert torch.isfinite(a.float()).all() and torch.equal(a, b)
    for full, skipped in zip(with_pass, bypassed):
        assert "time/old_logprob" in full and "time/old_logprob" not in skipped
        assert "mismatch/checked_frac" not in full
        assert skipped["mismatch/logp_abs_diff_max"] == 0.0 == full["mismatch/logp_abs_diff_max"]
        frac = skipped["mismatch/checked_frac"]
        assert (frac == 1.0) if minis == 1 else (0.0 < frac < 1.0), frac
        for key in ("actor/pg_loss", "actor/kl_ref", "kl_ref/k3", "actor/grad_norm", "mismatch/is_ratio_max"):
            assert skipped[key] == full[key], (key, skipped[key], full[key])


@pytest.mark.parametrize("config_exact", [True, False])
def test_trainer_rejects_an_engine_built_otherwise(config_exact):
    """The run config's ``exact`` and the engine's must agree (an exact run trusting a fast engine's log-probs, or the
    reverse, would compare two different computations)."""
    from jetrl.rl.trainer import Trainer

    cfg = load_config(None, ["--recipe=bf16", f"--exact={str(config_exact).lower()}"])
    model = build_model(DecoderConfig(**CONFIG), dtype=torch.float32, recipe="bf16", seed=0)
    engine = RolloutEngine(model, max_num_seqs=4, num_blocks=16, block_size=4, progress=False, exact=not config_exact)
    with pytest.raises(ValueError, match="exact"):
        Trainer(cfg, model, engine, _Prompts(3), _reward, _decode)


def test_config_exact_field():
    assert load_config(None, ["--recipe=jet", "--exact=true"]).exact is True
    assert load_config(None, ["--recipe=bf16"]).exact is False
    with pytest.raises(ConfigError, match="exact"):
        load_config(None, ["--recipe=fp8-rollout", "--exact=true"])


def test_engine_rejects_exact_under_fp8_rollout():
    model = build_model(DecoderConfig(**CONFIG), dtype=torch.bfloat16, recipe="fp8-rollout", seed=0)
    with pytest.raises(ValueError, match="exact mode needs the same precision"):
        RolloutEngine(model, num_blocks=8, block_size=4, progress=False, exact=True)


@pytest.mark.parametrize("bias", [(True, True, True), (False, False, False), (False, True, True)])
def test_linears_sharing_an_input_group_to_their_own_exact_bits(bias):
    """q/k/v (and gate/up) in exact mode: a no-grad step hands the shared FP8 input to the backend's
    ``grouped_gemm_exact``; each layer's slice, bias added as FP8Linear adds it, is bitwise that layer's own exact
    forward (the reference backend groups by concatenation, the CUDA one in one decode-kernel launch); members
    with and without a bias (q without, k and v with) keep each its own."""
    from jetrl.quant import FP8Linear, call_linear, linears_shared_input

    g = torch.Generator()
    g.seed()  # fresh inputs on every run
    mods = [FP8Linear(256, n, bias=b, dtype=torch.bfloat16) for n, b in zip((256, 128, 128), bias)]
    for m in mods:
        with torch.no_grad():
            m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.05)
            if m.bias is not None:
                m.bias.copy_(torch.randn(m.bias.shape, generator=g))
    x = torch.randn(5, 256, generator=g).to(torch.bfloat16)
    x_fp8 = quantize_tensor(x, ACT)
    with torch.no_grad():
        grouped = linears_shared_input(mods, x, x_fp8, exact=True)
        alone = [call_linear(m, x, x_fp8, exact=True) for m in mods]
    assert [tuple(y.shape) for y in grouped] == [(5, 256), (5, 128), (5, 128)]
    for y, ref in zip(grouped, alone):
        assert torch.isfinite(ref).all() and torch.equal(y, ref)


# ------------------------------------------------------------------ several CPU threads
# torch splits an elementwise op or a reduction over a large tensor among its threads at places that depend on the
# tensor's size; an op whose kernel computes an element differently near such a place (ATen's CPU silu: the SIMD exp
# on whole vectors, the C library's on the leftovers) is then batch-dependent at some thread counts and not at others
# (e.g. fine at 1 and 2 threads, off by an ulp at 3 and 4). The tests above run on one thread; these at several.
# More threads than cores is fine: only the split matters, not the speed.

THREADS = (2, 3, 4)


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads", THREADS, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_exact_swiglu_is_batch_invariant(threads, dtype):
    """Exact mode's SwiGLU: a row's bits alone, at any offset in batches of any size, split among any number of
    threads, and from the packed (strided) gate/up of a grouped projection; close to ``F.silu`` and with its
    gradient."""
    from jetrl.quant.swiglu import silu, swiglu, swiglu_packed

    g = torch.Generator().manual_seed(8)
    for k in (352, 100):  # the tiny-arith MLP's width; one that leaves a remainder of a SIMD vector in every row
        gate, up = ((torch.randn(301, k, generator=g) * 4).to(dtype) for _ in range(2))
        alone = torch.cat([swiglu(gate[i:i + 1], up[i:i + 1], exact=True)[0] for i in range(301)])
        for start, stop in ((0, 301), (0, 97), (5, 300), (200, 201), (1, 256)):
            out, _ = swiglu(gate[start:stop], up[start:stop], exact=True)
            assert torch.equal(out, alone[start:stop]), (k, start, stop)
        packed, _ = swiglu_packed(torch.cat([gate, up], -1), exact=True)
        assert torch.equal(packed, alone), k
        torch.testing.assert_close(silu(gate, exact=True).float(), torch.nn.functional.silu(gate).float(),
                                   rtol=2 * torch.finfo(dtype).eps, atol=0)
    x = (torch.randn(97, 100, generator=g) * 4).to(dtype).requires_grad_(True)
    grad = torch.randn(97, 100, generator=g).to(dtype)
    ours = torch.autograd.grad(silu(x, exact=True), x, grad)[0]
    assert torch.equal(ours, torch.autograd.grad(torch.nn.functional.silu(x), x, grad)[0])


@pytest.mark.parametrize("threads", THREADS, indirect=True)
def test_exact_ops_are_batch_invariant_at_several_threads(threads):
    """The other ops of the exact forward (batch-invariant GEMM, RMSNorm, RoPE, log-probabilities, attention) at
    several thread counts, with batches large enough that torch splits their work among the threads."""
    from jetrl.models.logprobs import exact_logprobs_from_logits
    from jetrl.models.rope import apply_rope_qk

    g = torch.Generator().manual_seed(9)
    rows = ([0], [299, 3], list(range(40, 137)), list(range(300)))
    for n, k in ((352, 128), (128, 352), (26, 128)):
        w, x = torch.randn(n, k, generator=g) * 0.05, torch.randn(300, k, generator=g)
        full = row_invariant_matmul(x, w)
        for r in rows:
            assert torch.equal(row_invariant_matmul(x[r], w), full[r]), (n, k, r)
    x, res = torch.randn(300, 128, generator=g), torch.randn(300, 128, generator=g)
    w = torch.rand(128, generator=g) + 0.5
    q, kk = torch.randn(300, 4, 32, generator=g), torch.randn(300, 2, 32, generator=g)
    cos, sin = torch.randn(300, 32, generator=g), torch.randn(300, 32, generator=g)
    full_norm, full_rope = rms_norm(x, w, 1e-5, res), apply_rope_qk(q, kk, cos, sin)
    for r in rows:
        norm = rms_norm(x[r], w, 1e-5, res[r])
        assert torch.equal(norm.out, full_norm.out[r]) and torch.equal(norm.residual, full_norm.residual[r])
        rope = apply_rope_qk(q[r], kk[r], cos[r], sin[r])
        assert torch.equal(rope[0], full_rope[0][r]) and torch.equal(rope[1], full_rope[1][r])
    for vocab in (26, 1000):
        logits = torch.randn(300, vocab, generator=g) * 4
        targets, temps = torch.randint(0, vocab, (300,), generator=g), torch.ones(300)
        full = exact_logprobs_from_logits(logits, targets, temps)[0]
        for r in rows:
            assert torch.equal(exact_logprobs_from_logits(logits[r], targets[r], temps[r])[0], full[r]), (vocab, r)
    # attention: each sequence packed with the others and alone, and its last token as a decode row among the other
    # sequences' last tokens (as many decode rows as head_dim or fewer: the shapes whose work is split differently)
    lengths = [3, 70, 1, 129, 40, 8]
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    for head_dim in (32, 128):
        q, kk, v = (torch.randn(cu[-1], h, head_dim, generator=g) for h in (4, 2, 2))
        packed = exact_varlen_attention(q, kk, v, cu, head_dim ** -0.5)
        for i, (a, b) in enumerate(zip(cu, cu[1:])):
            alone = exact_varlen_attention(q[a:b], kk[a:b], v[a:b], [0, b - a], head_dim ** -0.5)
            assert torch.equal(alone, packed[a:b]), (head_dim, i)
        tables = torch.full((len(lengths), max(lengths)), -1, dtype=torch.int32)
        for i, (a, b) in enumerate(zip(cu, cu[1:])):
            tables[i, :b - a] = torch.arange(a, b, dtype=torch.int32)
        meta = PagedAttentionMetadata(torch.arange(len(lengths) + 1, dtype=torch.int32),
                                      torch.tensor(lengths, dtype=torch.int32), tables,
                                      torch.zeros(len(lengths), dtype=torch.long), 1, max(lengths))
        last = torch.tensor(cu[1:]) - 1
        decode = exact_attention_reference(q[last], kk[:, None], v[:, None], meta, head_dim ** -0.5)
        assert torch.equal(decode, packed[last]), head_dim


@pytest.mark.parametrize("threads", (3, 4), indirect=True)
@pytest.mark.parametrize("recipe,dtype", [("bf16", torch.float32), ("bf16", torch.bfloat16), ("jet", torch.float32)],
                         ids=["bf16-float32", "bf16-bfloat16", "jet-float32"])
def test_engine_logprobs_equal_training_forward_bitwise_at_several_threads(models, threads, recipe, dtype):
    """The engine against the trainer's packed forward (one batch of every sequence, and odd micro-batches) with
    torch on several threads: a micro-batch of hundreds of tokens has its elementwise ops split among the threads,
    the engine's decode steps of a few rows do not."""
    model = models[(recipe, dtype)] if (recipe, dtype) in models else \
        build_model(DecoderConfig(**CONFIG), dtype=dtype, recipe=recipe, seed=0)
    prompts = _prompts(7, seed=21)
    engine = RolloutEngine(model, max_num_seqs=8, num_blocks=256, block_size=4, max_num_batched_tokens=48,
                           progress=False, exact=True)
    outs = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=10, seed=5, ignore_eos=True))
    for micro in (None, 5, 7):
        for c, lp in zip(outs, _score(model, prompts, outs, micro)):
            engine_lp = torch.tensor(c.logprobs, dtype=torch.float32)
            assert torch.equal(engine_lp, lp), (threads, micro, (engine_lp - lp).abs().max())


@pytest.mark.parametrize("threads", (3, 4), indirect=True)
@pytest.mark.parametrize("recipe,dtype,shape", [
    ("bf16", torch.float32, (5, 3, 15, 5)), ("bf16", torch.float32, (7, 3, 21, 7)),
    ("bf16", torch.bfloat16, (5, 3, 15, 5)), ("jet", torch.float32, (3, 3, 9, 3))],
    ids=lambda v: str(v).replace("torch.", "") if not isinstance(v, tuple) else "P{}-n{}-mini{}-micro{}".format(*v))
def test_exact_over_several_steps_at_several_threads(threads, recipe, dtype, shape):
    """:func:`test_exact_over_several_steps` with torch on several threads (the issue's case: the bf16 recipe on
    float32 weights, five prompts of three samples, micro-batches of five, at three or four threads): zero mismatch
    at every step, before and after the optimizer moved the weights."""
    num_prompts, n, mini, micro = shape
    trainer = _trainer(recipe, dtype, (f"--data.prompts_per_step={num_prompts}", f"--rollout.n={n}",
                                       f"--algorithm.mini_batch_size={mini}", f"--algorithm.micro_batch_size={micro}",
                                       "--rollout.max_tokens=12", "--optim.lr=1e-2"))
    trainer.prompts = _Prompts(num_prompts)
    for step in range(3):
        metrics = trainer.step()
        assert metrics["mismatch/logp_abs_diff_max"] == 0.0, (threads, step, metrics["mismatch/logp_abs_diff_max"])
