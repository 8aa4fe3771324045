"""The RL step on a tiny random model and a toy task (CPU): learning, mismatch metrics, resume."""

import math
import warnings

import pytest
import torch

from jetrl.config import load_config
from jetrl.rl.trainer import Trainer
from toy_rl import MODEL, ToyPrompts, decode, low_token_reward


def make_trainer(recipe="bf16", overrides=(), dtype=torch.float32):
    from jetrl.models import DecoderConfig, build_model
    from jetrl.rollout import RolloutEngine

    cfg = load_config(None, [f"--recipe={recipe}", "--data.prompts_per_step=4", "--rollout.n=4",
                             "--rollout.max_tokens=8", "--algorithm.mini_batch_size=8",
                             "--algorithm.micro_batch_size=4", "--optim.lr=1e-2", "--optim.grad_clip=1.0",
                             "--trainer.steps=20", *overrides])
    model = build_model(DecoderConfig(**MODEL), dtype=dtype, recipe=recipe, seed=0)
    engine = RolloutEngine(model, max_num_seqs=16, num_blocks=64, block_size=4, progress=False, exact=cfg.exact,
                           kv_fp8=cfg.kv_fp8)
    return Trainer(cfg, model, engine, ToyPrompts(4), low_token_reward, decode)


def weights(model) -> dict[str, torch.Tensor]:
    """Every parameter's values by name, from the state dict (jet's FP8 linears hold theirs in the optimizer's
    masters: their parameters are placeholders)."""
    state = model.state_dict()
    return {name: state[name].clone() for name, _ in model.named_parameters()}


def run_and_check_learning(recipe, steps):
    trainer = make_trainer(recipe)
    start = weights(trainer.model)
    rewards = []
    for _ in range(steps):
        m = trainer.step()
        assert all(not isinstance(v, float) or not math.isnan(v) for v in m.values()), m
        rewards.append(m["reward/mean"])
    # the toy reward starts near 0.5 (half the vocabulary is "low") and reaches ~0.9 within 8 steps
    assert sum(rewards[-4:]) / 4 > sum(rewards[:4]) / 4 + 0.15, rewards
    for k, v in weights(trainer.model).items():
        assert torch.isfinite(v.float()).all() and not torch.equal(v, start[k]), f"{k} did not change"
    assert trainer.step_count == steps and m["actor/num_updates"] == 2
    return m


def test_reward_rises_and_every_parameter_changes_bf16():
    m = run_and_check_learning("bf16", 8)
    # fp32 weights on CPU: rollout and training log-probs agree to fp32 rounding
    assert m["mismatch/logp_abs_diff_max"] < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["jet", "fp8-rollout"])
def test_reward_rises_fp8_recipes(recipe):
    run_and_check_learning(recipe, 8)


def test_mismatch_ordering_across_recipes():
    """Same weights, same sampled tokens: jet's rollout/training mismatch is at rounding level, well
    below fp8-rollout's (FP8 sampling vs BF16 scoring)."""
    results = {}
    for recipe in ("bf16", "jet", "fp8-rollout"):
        trainer = make_trainer(recipe, ["--rollout.max_tokens=16", "--data.prompts_per_step=8",
                                        "--algorithm.mini_batch_size=32", "--algorithm.micro_batch_size=16"])
        items = trainer.prompts.next_batch()
        completions, _ = trainer.rollout(items)
        batch = trainer.build_batch(items, completions)
        from jetrl.rl.mismatch import mismatch_metrics
        results[recipe] = mismatch_metrics(batch.rollout_logprobs, trainer.score(trainer.model, batch), batch.mask)
        print(recipe, {k: f"{v:.2e}" for k, v in results[recipe].items()})
    assert results["bf16"]["logp_abs_diff_max"] < 1e-4  # fp32 weights: fp32 rounding of two summation orders
    # jet: identical quantization on both sides; FP8 rounding amplifies summation-order differences only
    assert results["jet"]["logp_abs_diff_max"] < 1e-3
    # fp8-rollout: FP8 weights/activations against fp32 ones: a different policy, clearly off
    assert results["fp8-rollout"]["logp_abs_diff_mean"] > 5 * results["jet"]["logp_abs_diff_mean"] + 1e-4


# SmolLM2-135M's shapes (two of its 30 blocks, a smaller vocabulary): in-features 576 (four and a half 128-blocks),
# 9 query heads and 3 KV heads of 64 (k/v 192 wide, q/k/v not stackable into whole 128-row tiles), tied embeddings
SMOLLM2_BLOCKS = dict(model_type="llama", vocab_size=512, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=64,
                      tie_word_embeddings=True, eos_token_id=1, rope_theta=100000.0)


def test_jet_is_on_policy_on_the_cpu_at_smollm2_shapes():
    """BF16 weights at SmolLM2's shapes, the engine's samples scored by the trainer: on the CPU, where the reference
    GEMM and attention sum exactly and round once, a row's result does not depend on how many rows a call holds
    (a decode step's few or a whole sequence's), so jet's two sides compute the same FP8 policy: log-probs equal up to
    the fp32 order of the two log-softmaxes, as bf16's. fp8-rollout's differ by the FP8 rounding itself."""
    # oneDNN's BF16 GEMM (on CPUs with AMX or AVX512-BF16) blocks by the call's row count, so a row's bits depend on
    # the rows beside it there; PyTorch's own CPU GEMM, which sums every row alike in fp32, is this check's premise
    with torch.backends.mkldnn.flags(enabled=False):
        results = {recipe: _smollm2_mismatch(recipe) for recipe in ("bf16", "jet", "fp8-rollout")}
    assert results["bf16"]["logp_abs_diff_max"] < 1e-4 and results["jet"]["logp_abs_diff_max"] < 1e-4, results
    assert results["fp8-rollout"]["logp_abs_diff_mean"] > 100 * results["jet"]["logp_abs_diff_mean"] + 1e-3, results


def _smollm2_mismatch(recipe: str) -> dict:
    from jetrl.models import DecoderConfig, build_model
    from jetrl.rl.mismatch import mismatch_metrics
    from jetrl.rollout import RolloutEngine

    cfg = load_config(None, [f"--recipe={recipe}", "--data.prompts_per_step=3", "--rollout.n=2",
                             "--rollout.max_tokens=13", "--algorithm.mini_batch_size=6",
                             "--algorithm.micro_batch_size=6", "--rollout.temperature=1.0"])
    model = build_model(DecoderConfig(**SMOLLM2_BLOCKS), dtype=torch.bfloat16, recipe=recipe, seed=3)
    engine = RolloutEngine(model, max_num_seqs=6, num_blocks=64, block_size=4, progress=False)
    trainer = Trainer(cfg, model, engine, ToyPrompts(3), low_token_reward, decode)
    items = trainer.prompts.next_batch()
    completions, _ = trainer.rollout(items)
    batch = trainer.build_batch(items, completions)
    return mismatch_metrics(batch.rollout_logprobs, trainer.score(model, batch), batch.mask)


def test_resume_is_bitwise(tmp_path):
    from jetrl.train.policy import resume_trainer, save_trainer_checkpoint

    """2N steps straight == N steps, checkpoint, (a step that is lost), resume, N steps; N = 1 with two
    optimizer steps per RL step, so the restored Adam moments and LR schedule are exercised."""
    straight = make_trainer("bf16")
    ref_metrics = [straight.step() for _ in range(2)]

    first = make_trainer("bf16")
    first.step()
    save_trainer_checkpoint(first, tmp_path, metrics_cursor=0)
    first.step()  # the run goes on, then is killed before the next checkpoint
    del first

    resumed = make_trainer("bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the same config: no schedule changed
        state = resume_trainer(resumed, tmp_path)
    assert state["step"] == 1 and resumed.step_count == 1 and resumed.prompts.pos == 4
    again = [resumed.step()]
    timing = ("time/", "throughput/")
    for a, b in zip(ref_metrics[1:], again):
        assert {k: v for k, v in a.items() if not k.startswith(timing)} == \
            {k: v for k, v in b.items() if not k.startswith(timing)}
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(straight.optimizer.masters, resumed.optimizer.masters):
        assert torch.equal(a, b)


def test_resume_says_when_the_checkpoints_lr_schedule_overrides_the_config(tmp_path):
    """A run resumed with more steps or another LR continues the schedule its checkpoint holds (LambdaLR's state
    carries it): a warning names what the config asked for instead, so a cosine decay that already reached its
    floor does not silently train the added steps at that floor."""
    from jetrl.train.policy import resume_trainer, save_trainer_checkpoint

    first = make_trainer("bf16", ["--optim.schedule=cosine"])
    first.step()
    save_trainer_checkpoint(first, tmp_path, metrics_cursor=0)
    longer = make_trainer("bf16", ["--optim.schedule=cosine", "--trainer.steps=40", "--optim.lr=2e-2"])
    with pytest.warns(RuntimeWarning, match=r"its LR schedule goes on.*total_steps 40 \(configured: 80\).*"
                                            r"base_lrs \[0.01.*\] \(configured: \[0.02"):
        resume_trainer(longer, tmp_path)
    assert longer.scheduler.lr_lambdas[0].total_steps == 40


def test_all_options_in_one_step():
    """KL to a reference, entropy bonus, TIS, bypass, sequence aggregation, token packing, 2 PPO epochs."""
    trainer = make_trainer("fp8-rollout", ["--algorithm.kl_coef=0.1", "--algorithm.entropy_coef=0.01",
                                           "--algorithm.tis_cap=2", "--algorithm.use_rollout_logprobs=true",
                                           "--algorithm.agg=sequence", "--algorithm.ppo_epochs=2",
                                           "--algorithm.max_tokens_per_micro_batch=520",
                                           "--algorithm.advantage_estimator=rloo"])
    assert trainer.ref_model is not None
    m = trainer.step()
    assert m["actor/num_updates"] == 4  # 2 epochs x 2 mini-batches
    for key in ("actor/kl_ref", "actor/entropy", "mismatch/tis_weight_mean", "kl_ref/k3", "actor/clip_frac",
                "time/reference", "throughput/rollout_tokens_per_s", "rollout/preemptions",
                "throughput/rollout_decode_tokens_per_s", "time/rollout_host", "time/rollout_graph_capture"):
        assert key in m and math.isfinite(m[key]), key
    assert m["actor/entropy"] > 0
    m = trainer.step()  # the policy moved away from the reference
    assert m["kl_ref/k3"] > 0


def test_run_reports_missing_inputs_before_loading(tmp_path):
    from jetrl.config import ConfigError, RunConfig
    from jetrl.rl.loop import run

    with pytest.raises(ConfigError, match="no prompts: set data.path"):
        run(RunConfig())
    with pytest.raises(ConfigError, match="model.path is empty"):
        run(load_config(None, ["--data.task=arithmetic", f"--trainer.output_dir={tmp_path}"]))


def test_old_logprobs_from_update_equals_the_separate_pass():
    """One optimizer step per RL step: taking the old log-probs from the update's own forward gives the same
    update and metrics as the separate old_logprob pass (up to fp32 summation order: the two pack different
    micro-batches), skips that pass, and keeps the ratio at exactly 1."""
    one_step = ["--algorithm.mini_batch_size=16", "--algorithm.kl_coef=0.1"]
    base = make_trainer("bf16", one_step)
    reuse = make_trainer("bf16", one_step + ["--algorithm.old_logprobs_from_update=true"])
    start = {k: v.detach().clone() for k, v in base.model.named_parameters()}
    a, b = base.step(), reuse.step()
    assert "time/old_logprob" in a and "time/old_logprob" not in b and "time/update" in b
    assert b["actor/ratio_mean"] == 1.0 and b["actor/clip_frac"] == 0.0
    for key in ("reward/mean", "response/length_mean", "advantage/abs_mean"):
        assert a[key] == b[key], key  # the same rollout
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_ref", "mismatch/logp_abs_diff_mean",
                "kl_ref/k3"):
        assert math.isfinite(b[key]) and abs(a[key] - b[key]) <= 1e-4 * max(1e-3, abs(a[key])), (key, a[key], b[key])
    with torch.no_grad():
        moved = sum(float((p - start[k]).norm() ** 2) for k, p in base.model.named_parameters()) ** 0.5
        apart = sum(float((p - q).norm() ** 2) for p, q in zip(base.model.parameters(), reuse.model.parameters())) ** 0.5
    assert moved > 0 and apart <= 1e-4 * moved, (apart, moved)


def test_old_logprobs_from_update_with_tis_in_fp8_rollout():
    trainer = make_trainer("fp8-rollout", ["--algorithm.mini_batch_size=16", "--algorithm.tis_cap=2",
                                           "--algorithm.old_logprobs_from_update=true"])
    m = trainer.step()
    assert m["actor/num_updates"] == 1 and "time/old_logprob" not in m
    for key in ("mismatch/tis_weight_mean", "mismatch/logp_abs_diff_mean", "actor/pg_loss"):
        assert math.isfinite(m[key]) and (key != "mismatch/logp_abs_diff_mean" or m[key] > 0), key
    assert trainer.update_logprobs is not None and trainer.update_logprobs.shape == (16, 8)


@pytest.mark.parametrize("extra,match", [
    (["--algorithm.ppo_epochs=2"], "one optimizer step per RL step"),
    (["--algorithm.mini_batch_size=8"], "one optimizer step per RL step"),
    (["--algorithm.use_rollout_logprobs=true"], "set one of them"),
])
def test_old_logprobs_from_update_needs_a_single_step(extra, match):
    from jetrl.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        load_config(None, ["--data.prompts_per_step=4", "--rollout.n=4", "--algorithm.mini_batch_size=16",
                           "--algorithm.old_logprobs_from_update=true", *extra])


def test_jet_with_fp8_kv_cache_trains_on_the_values_it_sampled_from():
    """jet + kv_fp8 in exact mode: the engine reads an FP8 KV cache, the trainer's forward fake-quantizes K and V,
    and the step's rollout/training mismatch is exactly zero; the update trains every parameter (the K/V
    projections through the straight-through estimator)."""
    trainer = make_trainer("jet", ["--kv_fp8=true", "--exact=true"], dtype=torch.bfloat16)
    assert trainer.config.kv_fp8_train and trainer.engine.kv_fp8
    start = weights(trainer.model)
    m = trainer.step()
    assert all(not isinstance(v, float) or math.isfinite(v) for v in m.values()), m
    assert m["mismatch/logp_abs_diff_max"] == 0.0 and m["response/num_tokens"] > 0
    assert m["rollout/kv_capacity_tokens"] == 64 * 4 and m["actor/num_updates"] == 2
    for k, v in weights(trainer.model).items():
        assert torch.isfinite(v.float()).all() and not torch.equal(v, start[k]), f"{k} did not change"


def test_a_run_runs_under_its_kernel_settings(tmp_path):
    """``jetrl.rl.loop.run`` holds the config's kernel settings in force for the whole run (rollout and training read
    them), and restores the defaults after."""
    from pathlib import Path

    import jetrl
    from jetrl.quant.kernels import tuning
    from jetrl.rl.loop import run

    seen = []
    cfg = load_config(None, [f"--model.path={Path(jetrl.__file__).parent / 'assets' / 'tiny-arith'}", "--model.device=cpu",
                             "--model.dtype=float32", "--data.task=arithmetic", "--data.prompts_per_step=2",
                             "--data.max_prompt_tokens=64", "--rollout.n=2", "--rollout.max_tokens=4",
                             "--algorithm.micro_batch_size=4", "--trainer.steps=1",
                             f"--trainer.output_dir={tmp_path / 'run'}", "--kernels=exact_split_k=3,decode_max_m=8"])
    run(cfg, on_step=lambda step, m: seen.append((tuning.current().exact_split_k, tuning.current().decode_max_m)))
    assert seen == [(3, 8)]
    assert tuning.current().exact_split_k == tuning.KernelTuning().exact_split_k
    assert "exact_split_k=3" in (tmp_path / "run" / "config.yaml").read_text()  # a resumed run gets them too
