"""Accuracy of a policy on a prompt dataset or built-in task (greedy or sampled, with pass@k), and plain
completions of text prompts.

Generation goes through :class:`jetrl.rollout.RolloutEngine` (the same engine, precision recipe and
log-probability definition as RL rollouts); rewards through the dataset's reward function in a
:class:`jetrl.data.RewardPool` (so a pathological answer cannot hang evaluation). A sample counts as
correct when its reward is at least 1. A failed reward is not a wrong answer: as in training, failed
samples score 0 and are counted (``reward_errors``, ``reward_timeouts``), and evaluation stops with
:class:`~jetrl.data.reward_pool.RewardFailureError` when every sample of a batch failed (by default; see
``stop_fraction``): a broken reward function must not read as 0% accuracy. A prompt whose tokens plus
``max_tokens`` do not fit in the model's context is an error, not a silently shortened answer.

pass@k uses the unbiased estimator of Chen et al. (2021), averaged over prompts. Greedy decoding
(``temperature=0``) draws one sample per prompt, so its accuracy is pass@1.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from jetrl.config import RunConfig
from jetrl.data import Prompt, PromptDataset, RewardPool, RewardPoolConfig, build_prompt_dataset, render_prompt
from jetrl.data.reward_pool import RewardFailureGuard
# the RL loop's own prompt encoding (a single BOS under chat templates) and reward text (no special tokens)
from jetrl.data.templates import decode_completion, encode_prompt
from jetrl.models import check_eos, check_tokenizer, load_model, load_tokenizer, resolve_checkpoint, resolve_device
from jetrl.models.config import DecoderConfig
from jetrl.progress import Progress
from jetrl.rollout import RolloutEngine, SamplingParams

EVAL_REWARD_WORKERS = 1  # reward processes of an evaluation (evaluate's default)
EVAL_SEED = 12345  # task seed of held-out problems (the embedded model's README reports accuracy on it)


@dataclass
class EvalResult:
    """Accuracy (fraction of correct samples), mean reward, pass@k per k, response length and truncation, the
    failed rewards, and the samples themselves (with :func:`evaluate`'s ``keep_samples``)."""

    num_prompts: int
    n: int
    accuracy: float
    mean_reward: float
    pass_at_k: dict[int, float]
    mean_length: float
    truncation_rate: float
    samples: list[dict[str, Any]] = field(default_factory=list)
    reward_errors: int = 0
    reward_timeouts: int = 0

    def rows(self) -> list[tuple[str, str]]:
        """(name, value) pairs for a summary table."""
        rows = [("prompts", str(self.num_prompts)), ("samples per prompt", str(self.n)),
                ("accuracy", f"{self.accuracy:.4f}"), ("mean reward", f"{self.mean_reward:.4f}")]
        rows += [(f"pass@{k}", f"{v:.4f}") for k, v in sorted(self.pass_at_k.items())]
        rows += [("mean response tokens", f"{self.mean_length:.1f}"), ("truncated", f"{self.truncation_rate:.2%}"),
                 ("failed rewards", f"{self.reward_errors} errors, {self.reward_timeouts} timeouts")]
        return rows


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with ``c`` correct among ``n`` samples (``k <= n``):
    ``1 - C(n - c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # C(n - c, k) is 0 for k > n - c


def evaluate(model: torch.nn.Module, tokenizer: Any, dataset: PromptDataset, *, reward: str | None = None, n: int = 1,
             temperature: float = 0.0, top_p: float = 1.0, max_tokens: int = 256, ks: Sequence[int] = (1,),
             seed: int = 0, batch_size: int = 64, progress: bool = False, keep_samples: bool = False,
             reward_workers: int = EVAL_REWARD_WORKERS, stop_fraction: float = 1.0,
             max_abs_reward: float | None = None, kv_fp8: bool = False) -> EvalResult:
    """Generate ``n`` completions for every prompt of ``dataset`` and score them.

    ``dataset`` is a :class:`jetrl.data.PromptDataset` (its ``reward`` name is used unless ``reward`` is
    given). ``temperature=0`` is greedy and needs ``n=1``. ``ks`` lists the k of pass@k (each <= n); pass@1 is
    always reported.
    ``reward_workers=0`` scores in this process (no timeout). ``stop_fraction``: stop when at least this
    fraction of a batch's rewards failed (see :class:`~jetrl.data.reward_pool.RewardFailureGuard`);
    ``max_abs_reward``: a reward of larger magnitude is a failure too. ``kv_fp8``: generate through an FP8 KV
    cache (a run's ``kv_fp8``; see :class:`~jetrl.rollout.RolloutEngine`), as the run's rollouts did.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if len(dataset) == 0:
        raise ValueError("nothing to evaluate: the dataset has no prompts")
    guard = RewardFailureGuard(stop_fraction=stop_fraction)
    if temperature == 0 and n > 1:
        raise ValueError(f"greedy decoding (temperature 0) gives one answer per prompt; use n=1 or a temperature "
                         f"> 0 for n={n}")
    ks = sorted({int(k) for k in ks} | {1})
    if ks[0] < 1:
        raise ValueError(f"pass@k needs k >= 1, got k={ks[0]}")
    if ks[-1] > n:
        raise ValueError(f"pass@{ks[-1]} needs at least {ks[-1]} samples per prompt; raise n (now {n})")
    reward_name = reward or dataset.reward
    if reward_name is None:
        raise ValueError("the dataset names no reward function; pass one (e.g. --reward gsm8k)")
    all_texts = [dataset.render(p, tokenizer) for p in dataset]  # every prompt checked before any is generated
    all_ids = _encode_fitting(model, tokenizer, all_texts, max_tokens, [p.index for p in dataset])
    engine = RolloutEngine(model, tokenizer, progress=False, max_num_seqs=max(1, min(256, batch_size * n)),
                           kv_fp8=kv_fp8)
    bar = Progress(len(dataset), "eval", unit="prompt", enabled=progress)
    correct_per_prompt: list[int] = []
    rewards_all: list[float] = []
    lengths: list[int] = []
    samples: list[dict[str, Any]] = []
    truncated = errors = timeouts = 0
    was_training = model.training
    model.eval()
    try:
        pool_config = RewardPoolConfig(num_workers=reward_workers, max_abs_reward=max_abs_reward)
        with RewardPool(reward_name, pool_config) as pool:
            for start in range(0, len(dataset), batch_size):
                prompts = [dataset[i] for i in range(start, min(len(dataset), start + batch_size))]
                texts = all_texts[start:start + batch_size]
                params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens,
                                         seed=(seed * 1_000_003 + start + i) % 2 ** 63) for i in range(len(texts))]
                completions, outputs = _generate(engine, tokenizer, all_ids[start:start + batch_size], params)
                result = pool.score(outputs, [prompts[j // n].answer for j in range(len(completions))])
                guard.check(result)
                errors, timeouts = errors + result.num_errors, timeouts + result.num_timeouts
                for i, prompt in enumerate(prompts):
                    group = result.rewards[i * n:(i + 1) * n]
                    correct_per_prompt.append(sum(r >= 1.0 for r in group))
                    if keep_samples:
                        samples += [{"index": prompt.index, "prompt": texts[i], "completion": outputs[i * n + j],
                                     "answer": prompt.answer, "reward": group[j]} for j in range(n)]
                rewards_all += result.rewards
                lengths += [len(c.token_ids) for c in completions]
                truncated += sum(c.finish_reason == "length" for c in completions)
                bar.update(len(prompts))
                bar.set_postfix(acc=f"{sum(correct_per_prompt) / (len(correct_per_prompt) * n):.3f}")
    finally:
        bar.close()
        engine.free_cache()
        model.train(was_training)
    num = len(correct_per_prompt)
    return EvalResult(
        num_prompts=num, n=n, accuracy=sum(correct_per_prompt) / (num * n),
        mean_reward=sum(rewards_all) / len(rewards_all),
        pass_at_k={k: sum(pass_at_k(n, c, k) for c in correct_per_prompt) / num for k in ks},
        mean_length=sum(lengths) / len(lengths), truncation_rate=truncated / len(lengths), samples=samples,
        reward_errors=errors, reward_timeouts=timeouts)


def write_samples(samples: Sequence[dict[str, Any]], path: str | os.PathLike) -> None:
    """Write ``samples`` (:attr:`EvalResult.samples`) to ``path``, one JSON object a line (its folder made)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)


def _encode_fitting(model: torch.nn.Module, tokenizer: Any, texts: Sequence[str], max_tokens: int,
                    names: Sequence[Any]) -> list[list[int]]:
    """The token ids of the rendered prompts ``texts``, each of which (named ``names[i]`` in the error) plus
    ``max_tokens`` must fit in the model's ``max_position_embeddings``: checked for all before any generation."""
    ids = [encode_prompt(tokenizer, t) for t in texts]
    context = model.config.max_position_embeddings
    for name, prompt in zip(names, ids):
        if len(prompt) + max_tokens > context:
            raise ValueError(f"prompt {name} has {len(prompt)} tokens; with max_tokens={max_tokens} that exceeds "
                             f"the model's context of {context} positions (max_position_embeddings); lower max_tokens")
    return ids


def _generate(engine: RolloutEngine, tokenizer: Any, ids: Sequence[list[int]],
              params: Sequence[SamplingParams]) -> tuple[list[Any], list[str]]:
    """The engine's completions of the prompts ``ids`` and their decoded texts."""
    completions = engine.generate(list(ids), params)
    return completions, [decode_completion(tokenizer, c.token_ids) for c in completions]


def held_out_accuracy(model_path: str, config: RunConfig, num_examples: int, seed: int = EVAL_SEED,
                      progress: bool = False, tokenizer: Any = None) -> float:
    """Greedy accuracy of the checkpoint at ``model_path`` on ``num_examples`` held-out problems, in the run's
    recipe, dtype and KV-cache format: the first rows of ``data.eval_path`` (a run on a file, e.g. GSM8K's test
    split beside its train split, read in the run's format), or problems of the run's built-in task drawn with
    another seed than the training prompts. ``progress`` shows a bar over the problems. ``tokenizer``: the one
    already loaded from ``model.tokenizer`` or ``model_path`` (None: loaded here)."""
    if config.data.eval_path is not None:
        data = dataclasses.replace(config.data, path=config.data.eval_path, task=None, max_examples=num_examples)
    elif config.data.task is not None:
        if seed == config.trainer.seed:
            raise ValueError(f"the held-out seed {seed} equals trainer.seed: the evaluation problems would be "
                             f"training problems")
        data = dataclasses.replace(config.data, num_examples=num_examples)
    else:
        raise ValueError("held-out accuracy of a run on a dataset file needs held-out prompts: set data.eval_path "
                         "(a file in the run's format)")
    dataset = build_prompt_dataset(data, seed=seed)
    model = load_model(model_path, dtype=getattr(torch, config.model.dtype),
                       device=resolve_device(config.model.device), recipe=config.recipe)
    if tokenizer is None:
        tokenizer = load_tokenizer(config.model.tokenizer or model_path)
    return evaluate(model, tokenizer, dataset, max_tokens=config.rollout.max_tokens, progress=progress,
                    stop_fraction=config.reward.stop_fraction, max_abs_reward=config.reward.max_abs,
                    kv_fp8=config.kv_fp8).accuracy


def generate_texts(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[str], *, n: int = 1,
                   temperature: float = 0.0, top_p: float = 1.0, max_tokens: int = 128, seed: int = 0,
                   raw: bool = False) -> list[list[str]]:
    """Completions (``n`` per prompt) of plain-text prompts. Without a chat template a prompt gets a
    trailing newline unless ``raw`` (the compact task format ends every prompt with one); with one, the
    prompt becomes a user turn."""
    texts = list(prompts)
    if not raw:
        rendered = (render_prompt(Prompt(index=i, answer="", text=p), tokenizer) for i, p in enumerate(prompts))
        texts = [text if text != p or p.endswith("\n") else p + "\n" for text, p in zip(rendered, prompts)]
    engine = RolloutEngine(model, tokenizer, progress=False, max_num_seqs=max(1, min(256, len(texts) * n)))
    params = [SamplingParams(n=n, temperature=temperature, top_p=top_p, max_tokens=max_tokens, seed=seed + i)
              for i in range(len(texts))]
    _, outs = _generate(engine, tokenizer, _encode_fitting(model, tokenizer, texts, max_tokens, range(len(texts))),
                        params)
    return [outs[i * n:(i + 1) * n] for i in range(len(texts))]


def load_policy(path: str, recipe: str, device: str | None, dtype: str, max_tokens: int) -> tuple[Any, Any]:
    """Model and tokenizer from a checkpoint folder, checked before the weights are read: the tokenizer
    against the model (EOS token, vocabulary, special tokens), ``max_tokens`` new tokens against the model's
    context, and the device against this machine."""
    device = resolve_device(device)
    folder = resolve_checkpoint(path)
    config = DecoderConfig.from_file(folder)
    config.check_context(max_tokens + 1, "--max-tokens plus one prompt token")
    tokenizer = load_tokenizer(folder)
    check_eos(tokenizer, folder, folder)
    check_tokenizer(tokenizer, config, folder)
    return load_model(folder, dtype=getattr(torch, dtype), device=device, recipe=recipe), tokenizer


__all__ = ["load_policy", "EVAL_REWARD_WORKERS", "EVAL_SEED", "EvalResult", "evaluate", "pass_at_k",
           "held_out_accuracy", "generate_texts", "write_samples"]
