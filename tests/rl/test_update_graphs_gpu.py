"""The update's micro-batches as CUDA graphs (GPU): a replay computes what the eager run of the same padded
micro-batch computes, follows the weights after an optimizer step, and matches the unpadded eager update."""

import copy

import pytest
import torch

import jetrl.models as jm
from jetrl.config import load_config
from jetrl.quant import refresh_fp8_weights
from jetrl.rl.micro_batch import (MicroBatchShape, bucket_shape, micro_batch_loss, micro_batch_sizes, pack,
                                  packed_logprobs)
from jetrl.rl.update_graphs import UpdateGraphs
from toy_rl import ragged_batch

pytestmark = pytest.mark.gpu

# head_dim 64 with q/k/v biases and 2 query heads per KV head (Qwen2), head_dim 128 with 4 (Qwen3, untied)
CFGS = {
    "qwen2-hd64": dict(model_type="qwen2", vocab_size=32000, hidden_size=256, intermediate_size=768,
                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                       max_position_embeddings=1024),
    "qwen3-hd128": dict(model_type="qwen3", vocab_size=32000, hidden_size=512, intermediate_size=1024,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=128,
                        tie_word_embeddings=False, max_position_embeddings=1024),
}
WIDTH = 300
TEMPERATURE = 0.9


def rel_err(a, b):
    assert torch.isfinite(a).all() and torch.isfinite(b).all()
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def setup(cfg_name, recipe, options=()):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = jm.build_model(CFGS[cfg_name], dtype=torch.bfloat16, device="cuda", recipe=recipe, seed=3)
    model.set_activation_checkpointing(True).train()
    alg = load_config(None, ["--algorithm.clip_high=0.28", "--algorithm.entropy_coef=0.01", *options]).algorithm
    batch = ragged_batch(7, num=12, vocab=32000, width=WIDTH, max_prompt=150, device="cuda")
    return model, alg, batch


def loss_inputs(batch, rows, gen):
    idx = torch.tensor(rows, device="cuda")
    mask = batch.mask[idx]
    old = torch.where(mask, batch.rollout_logprobs[idx] + 0.05 * torch.randn(mask.shape, generator=gen,
                                                                             device="cuda"), 0.0)
    return mask, batch.advantages[idx], dict(old_logprobs=old)


def eager_step(model, alg, packed, mask, adv, inputs, counts, on_device):
    """One micro-batch eagerly: the padded pack on the graphs' code path (``on_device``) or the trainer's
    unpadded one."""
    blob = packed.blob.cuda()
    lp, ent = packed_logprobs(model, packed, blob, TEMPERATURE, on_device=on_device)
    b, width = mask.shape
    s = packed.shape

    def grid(x):
        out = x.new_zeros(s.sequences, s.width)
        out[:b, :width] = x
        return out
    padded = {k: grid(v) for k, v in inputs.items()}
    adv_p = adv.new_zeros(s.sequences)
    adv_p[:b] = adv
    loss, stats = micro_batch_loss(alg, lp, ent, grid(mask), adv_p, num_tokens=counts[0], num_seqs=counts[1],
                                   max_len=WIDTH, **padded)
    loss.backward()
    return lp.detach()[:b, :width], stats


def graph_matches_eager(graphs, ref, alg, batch, rows, shape, gen, counts):
    """One micro-batch at ``shape`` through ``graphs`` and eagerly on ``ref``: log-probs and statistics bitwise
    equal, finite, and the log-probs of real tokens negative."""
    mask, adv, inputs = loss_inputs(batch, rows, gen)
    packed = pack(batch, rows, WIDTH, shape)
    lp_g, stats_g = graphs.run(packed, mask, adv, inputs, *counts)
    lp_e, stats_e = eager_step(ref, alg, packed, mask, adv, inputs, counts, on_device=True)
    torch.cuda.synchronize()
    assert torch.equal(lp_g, lp_e) and torch.equal(stats_g, stats_e)
    assert torch.isfinite(stats_g).all() and (lp_g[mask] < 0).all()


def common_shape(batch, micros):
    """One bucket shape that holds every micro-batch of ``micros``."""
    shapes = []
    for rows in micros:
        tokens, scored, longest = micro_batch_sizes(batch, rows)
        shapes.append(bucket_shape(tokens, scored, len(rows), WIDTH, longest))
    return MicroBatchShape(*(max(getattr(s, f) for s in shapes)
                             for f in ("tokens", "scored", "sequences", "width", "offsets", "max_seqlen")))


@pytest.mark.parametrize("recipe", ["bf16", "jet"])
@pytest.mark.parametrize("cfg_name", sorted(CFGS))
def test_replay_is_the_eager_run_of_the_same_shape(cfg_name, recipe):
    """Two micro-batches of one shape (the first captured, the second replayed), then the weights move and the
    first replays again: every log-prob and statistic is bitwise the eager run's, and the gradients agree to
    the run-to-run noise of flash attention's backward (it accumulates dQ with atomics, in no fixed order: fp32
    rounding in dQ, carried through BF16's 2^-8 and, in jet, an occasional FP8 rounding flip of 2^-4 on an
    element)."""
    model, alg, batch = setup(cfg_name, recipe)
    ref = copy.deepcopy(model)
    micros = [[0, 3, 4, 7], [1, 2, 5, 6, 8]]
    shape = common_shape(batch, micros)
    graphs = UpdateGraphs(model, alg, temperature=TEMPERATURE, kv_fp8=False, max_len=WIDTH)
    gen = torch.Generator(device="cuda").manual_seed(0)
    counts = (int(batch.mask.sum()), 12)

    def both(rows):
        graph_matches_eager(graphs, ref, alg, batch, rows, shape, gen, counts)

    for rows in micros:
        both(rows)
    assert graphs.captures == 1 and graphs.replays == 1
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-2, name
    # an optimizer step: the weights move in place and the FP8 caches are marked stale
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            step = 0.01 * torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.float32)
            p.add_(step.to(p.dtype))
            q.copy_(p)
            p.grad.zero_()
            q.grad = None
    refresh_fp8_weights(model)
    refresh_fp8_weights(ref)
    both(micros[0])
    assert graphs.captures == 1 and graphs.replays == 2  # the caches were re-quantized where the graph reads them


def spied_graphs(model, alg, fail_at: int | None = None):
    """Update graphs whose ``_step`` records, call by call, whether it ran under a capture (the list returned);
    the ``fail_at``-th call (1-based) raises instead, as a path that cannot be captured would."""
    graphs = UpdateGraphs(model, alg, temperature=TEMPERATURE, kv_fp8=False, max_len=WIDTH)
    calls = []
    step = graphs._step

    def spy(packed, g):
        calls.append(torch.cuda.is_current_stream_capturing())
        if len(calls) == fail_at:
            raise RuntimeError("not capturable before its eager run")
        return step(packed, g)
    graphs._step = spy
    return graphs, calls


FIRST, SECOND = [0, 3, 4, 7], [1, 2, 5, 6, 8, 9, 10, 11]  # micro-batches of two bucket shapes


def update_at_own_shapes(graphs, ref, alg, batch, seed):
    """``FIRST`` then ``SECOND`` through the graphs, each at its own bucket shape: log-probs and statistics
    bitwise the eager run's of the same padded micro-batch (on ``ref``); returns the two shapes."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    counts = (int(batch.mask.sum()), 12)
    shapes = [common_shape(batch, [rows]) for rows in (FIRST, SECOND)]
    assert shapes[0] != shapes[1]
    for rows, shape in zip((FIRST, SECOND), shapes):
        graph_matches_eager(graphs, ref, alg, batch, rows, shape, gen, counts)
    return shapes


@pytest.mark.parametrize("recipe", ["bf16", "jet"])
def test_a_later_shape_is_captured_without_an_eager_run(recipe):
    """The run's first shape warms up eagerly and is captured; a second shape is captured straight away (no
    eager run: every ``_step`` call happens under capture) and replayed, and that replay is bitwise the eager
    run of the same padded micro-batch, for the update and the scoring pass alike."""
    model, alg, batch = setup("qwen2-hd64", recipe)
    ref = copy.deepcopy(model)
    graphs, calls = spied_graphs(model, alg)
    shapes = update_at_own_shapes(graphs, ref, alg, batch, seed=2)
    assert calls == [False, True, True]  # first shape: eager, capture; second: capture only
    assert graphs.captures == 2 and graphs.replays == 1 and graphs.failed is None
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-2, name
    calls.clear()
    with torch.no_grad():
        for rows, shape in zip((FIRST, SECOND), shapes):
            packed = pack(batch, rows, WIDTH, shape)
            lp_g = graphs.score(packed, len(rows), batch.mask.shape[1])
            lp_e, _ = packed_logprobs(ref, packed, packed.blob.cuda(), TEMPERATURE, on_device=True)
            assert torch.equal(lp_g, lp_e[:len(rows), :batch.mask.shape[1]])
    assert calls == [False, True, True] and graphs.captures == 4 and graphs.replays == 2


def test_a_failed_direct_capture_warms_up_eagerly():
    """A later shape whose direct capture fails runs eagerly and is captured after it (the results bitwise the
    eager run's), and from then on every new shape warms up eagerly; the host time new shapes took is counted."""
    model, alg, batch = setup("qwen2-hd64", "jet")
    ref = copy.deepcopy(model)
    graphs, calls = spied_graphs(model, alg, fail_at=3)  # the second shape's direct capture
    update_at_own_shapes(graphs, ref, alg, batch, seed=3)
    assert calls == [False, True, True, False, True]
    assert graphs.captures == 2 and graphs.failed is None and not graphs.capture_first
    assert graphs.capture_seconds > 0
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel_err(p.grad, q.grad) < 1e-2, name


@pytest.mark.parametrize("recipe", ["bf16", "jet"])
def test_padded_graphs_match_the_unpadded_eager_update(recipe):
    """The trainer's two paths on the same micro-batches: graphs at bucket shapes against the eager update of
    the unpadded micro-batches. They differ by the GEMMs' row-count-dependent kernel choice (BF16 rounding) and,
    under FP8, by WGrad's last 128-token block sharing its scale with padded rows; in jet a BF16-level difference
    at an FP8 input flips E4M3 roundings (2^-4 on the element), so two FP8 runs differ by up to FP8's own error.
    The bound for jet is therefore relative to FP8's own effect: padding moves the gradient less than half as far
    as FP8 training moves it from BF16's (same weights, same micro-batches)."""
    model, alg, batch = setup("qwen2-hd64", recipe, ["--algorithm.kl_coef=0.05"])
    refs = [copy.deepcopy(model)]
    if recipe == "jet":
        refs.append(setup("qwen2-hd64", "bf16")[0])
    graphs = UpdateGraphs(model, alg, temperature=TEMPERATURE, kv_fp8=False, max_len=WIDTH)
    gen = torch.Generator(device="cuda").manual_seed(1)
    counts = (int(batch.mask.sum()), 12)
    for rows in ([0, 3, 4, 7], [1, 2, 5], [6, 8, 9, 10, 11]):
        mask, adv, inputs = loss_inputs(batch, rows, gen)
        inputs["ref_logprobs"] = inputs["old_logprobs"] - 0.02
        tokens, scored, longest = micro_batch_sizes(batch, rows)
        shape = bucket_shape(tokens, scored, len(rows), WIDTH, longest)
        lp_g, stats_g = graphs.run(pack(batch, rows, WIDTH, shape), mask, adv, inputs, *counts)
        plain = pack(batch, rows, batch.mask.shape[1])
        lp_e, stats_e = eager_step(refs[0], alg, plain, mask, adv, inputs, counts, on_device=False)
        for ref in refs[1:]:
            eager_step(ref, alg, plain, mask, adv, inputs, counts, on_device=False)
        assert rel_err(lp_g[mask], lp_e[mask]) < (1e-3 if recipe == "bf16" else 1e-2)
        # entry by entry (the token count would hide the others): losses and means to the log-probs' error, a
        # clip fraction to a few tokens flipping across the clip bound (1/num_tokens each)
        assert stats_g[0] == stats_e[0]  # num_tokens
        torch.testing.assert_close(stats_g[1:], stats_e[1:], rtol=2e-2, atol=2e-3)
    assert graphs.failed is None and graphs.captures >= 1

    def grads(m):
        return torch.cat([p.grad.flatten().float() for p in m.parameters()])
    err = rel_err(grads(model), grads(refs[0]))
    if recipe == "bf16":
        assert err < 1e-2
        for (name, p), q in zip(model.named_parameters(), refs[0].parameters()):
            assert rel_err(p.grad, q.grad) < 2e-2, name
    else:
        fp8_effect = rel_err(grads(refs[0]), grads(refs[1]))
        assert err < 0.5 * fp8_effect, (err, fp8_effect)


def test_trainer_replays_graphs_and_learns_like_eager():
    """A GPU trainer with graphs on: micro-batches of the toy task share their bucket, so after the first
    capture they replay; one RL step's update moves the parameters as the eager trainer's does."""
    from jetrl.models import DecoderConfig, build_model
    from jetrl.rl.trainer import Trainer
    from jetrl.rollout import RolloutEngine
    from toy_rl import MODEL, ToyPrompts, decode, low_token_reward

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    trainers = []
    for graphs in (True, False):
        cfg = load_config(None, ["--recipe=jet", "--data.prompts_per_step=4", "--rollout.n=4", "--rollout.max_tokens=8",
                                 "--algorithm.mini_batch_size=8", "--algorithm.micro_batch_size=4",
                                 "--optim.lr=1e-3", f"--algorithm.cuda_graphs={str(graphs).lower()}",
                                 "--model.device=cuda"])
        model = build_model(DecoderConfig(**MODEL), dtype=torch.bfloat16, device="cuda", recipe="jet", seed=0)
        engine = RolloutEngine(model, max_num_seqs=16, num_blocks=64, block_size=4, progress=False)
        trainers.append(Trainer(cfg, model, engine, ToyPrompts(4), low_token_reward, decode))
    with_graphs, eager = trainers
    assert with_graphs.update_graphs is not None and eager.update_graphs is None
    # the weights' values: the state dict (jet's FP8 linears hold theirs in the optimizer's masters on one process)
    def values(model):
        state = model.state_dict()
        return [state[name].clone() for name, _ in model.named_parameters()]

    start = values(with_graphs.model)
    m_g, m_e = with_graphs.step(), eager.step()
    assert with_graphs.update_graphs.captures >= 1 and with_graphs.update_graphs.replays >= 1
    assert with_graphs.update_graphs.failed is None
    assert m_g["reward/mean"] == m_e["reward/mean"]  # the same rollout: the policies were equal
    assert abs(m_g["actor/pg_loss"] - m_e["actor/pg_loss"]) < 1e-2
    # the updates, not the parameters (Adam's first steps move a weight by about lr): the same direction and size;
    # they differ where a gradient element is near 0 and its sign follows rounding
    moved_g = torch.cat([(p - s).flatten().float() for p, s in zip(values(with_graphs.model), start)])
    moved_e = torch.cat([(q - s).flatten().float() for q, s in zip(values(eager.model), start)])
    assert torch.isfinite(moved_g).all() and torch.isfinite(moved_e).all() and moved_e.norm() > 0
    assert torch.nn.functional.cosine_similarity(moved_g, moved_e, dim=0) > 0.8
    assert 0.8 < (moved_g.norm() / moved_e.norm()).item() < 1.25


@pytest.mark.parametrize("recipe", ["bf16", "jet"])
def test_scoring_graph_replays_the_eager_forward(recipe):
    """The old-logprob pass's forward-only graph: each replay is bitwise the eager forward of the same padded
    micro-batch (captured once, replayed for a second micro-batch of the shape and the first again)."""
    model, alg, batch = setup("qwen2-hd64", recipe)
    graphs = UpdateGraphs(model, alg, temperature=TEMPERATURE, kv_fp8=False, max_len=WIDTH)
    micros = [[0, 3, 4, 7], [1, 2, 5, 6, 8]]
    shape = common_shape(batch, micros)
    width = batch.mask.shape[1]
    with torch.no_grad():
        for rows in micros + micros[:1]:
            packed = pack(batch, rows, WIDTH, shape)
            lp_g = graphs.score(packed, len(rows), width)
            lp_e, _ = packed_logprobs(model, packed, packed.blob.cuda(), TEMPERATURE, on_device=True)
            assert torch.equal(lp_g, lp_e[:len(rows), :width])
            assert (lp_g[batch.mask[rows]] < 0).all()
    assert graphs.failed is None and graphs.captures == 1 and graphs.replays == 2
