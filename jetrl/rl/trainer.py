"""The RL step: prompts -> rollout -> rewards -> advantages -> old/reference log-probs -> PPO update.

One :meth:`Trainer.step`, in order (each phase timed):

1. **rollout** -- ``n`` samples per prompt from :class:`jetrl.rollout.RolloutEngine`, which runs the very
   module being trained on the rollout side of the precision recipe. Each prompt gets its own sampling
   seed derived from ``(trainer.seed, step, prompt)``, so a resumed run samples the same tokens.
2. **reward** -- the reward function scores the decoded completions; advantages follow from the
   ``(P, n)`` rewards (:mod:`jetrl.rl.advantages`).
3. **old_logprob** -- a training-side forward (no grad) recomputes the log-probabilities of the sampled
   tokens. These are the PPO "old" log-probs (as verl does), so ``fp8-rollout`` is reproduced faithfully:
   samples from the FP8 policy, ratios against the BF16 one. With ``use_rollout_logprobs`` (verl's
   "bypass") the engine's log-probs are the old ones instead. With ``old_logprobs_from_update`` (one
   optimizer step per RL step) this pass is skipped: the update's own forwards, before the policy moves,
   give them. Either way the training-side and the engine's log-probs are compared (:mod:`jetrl.rl.mismatch`).
   In exact mode they agree bit for bit, so ``use_rollout_logprobs`` skips this pass too: the check then runs
   on the update's first mini-batch, before the first optimizer step (``mismatch/checked_frac``: the share of
   the tokens checked).
4. **reference** -- with ``kl_coef > 0``, a frozen copy of the initial policy in the same recipe scores
   the tokens for the KL penalty.
5. **update** -- ``ppo_epochs`` passes over the batch in shuffled mini-batches (stratified over blocks of
   whole prompt groups, :mod:`jetrl.rl.minibatch`); each mini-batch is one optimizer step, accumulated over
   micro-batches (a fixed number of sequences, or packed up to a token budget). A micro-batch runs one packed
   forward of its sequences (:mod:`jetrl.rl.micro_batch`; on one GPU in fast mode padded to a bucket shape and
   replayed as a CUDA graph, :mod:`jetrl.rl.update_graphs`), and the loss is normalised by the *mini-batch*
   token / sequence counts, so accumulation is exact.
6. **weight_refresh** -- the FP8 linears re-quantize the updated BF16 weights (eagerly where the weights are whole
   on the rank, so the cost is measured here rather than hidden in the next rollout; a sharded model re-quantizes
   when the next rollout gathers its weights).

**Several GPUs** (:mod:`jetrl.parallel`). Every rank reads the same prompt batch and keeps its own
contiguous share of whole prompt groups; sampling seeds use the *global* prompt index, so the tokens do
not depend on the number of ranks. The policy (and reference) are sharded with FSDP2; rollout runs
inside :func:`jetrl.parallel.full_weights`. Advantages come from the gathered ``(P, n)`` rewards (exact
for batch-level baselines too). Each rank takes its ``mini_batch_size / world_size`` sequences of every
mini-batch, the same sets whatever the number of ranks (:mod:`jetrl.rl.minibatch`, which also says when the
micro-batches are the one process's; packed micro-batches are packed per rank); the loss normalisers (tokens and
sequences of the mini-batch) are summed over ranks, and FSDP2 sums the gradients, so N ranks make the one-process
update, up to the order in which gradients are summed. Ranks run the same number of forwards (FSDP2 gathers
inside each): a rank with fewer micro-batches repeats its first one with a zero loss. The step's metrics are
computed on the gathered batch (every rank's sequences) with the slowest rank's phase times, so they read like a
one-process run's.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.nn as nn

from jetrl.config import RunConfig
from jetrl.data.reward_pool import RewardResult
from jetrl.parallel import ParallelContext, full_weights, refresh_rollout_weights, shard_model
from jetrl.quant.recipe import fp8_linears, fp8_weight_bytes
from jetrl.rl.advantages import compute_advantages
from jetrl.rl.batch import RolloutBatch
from jetrl.rl.losses import truncated_is_weights
from jetrl.rl.micro_batch import micro_batch_loss, pack, packed_logprobs, stat_names
from jetrl.rl.metrics import PhaseTimer, global_engine_stats, step_metrics
from jetrl.rl.minibatch import mini_batch_rows
from jetrl.train.optim import (MasterWeightAdamW, OptimizerStepper, build_lr_scheduler, release_fp8_weights,
                            restore_fp8_weights)
from jetrl.rl.update_graphs import UpdateGraphs, graphs_apply
from jetrl.rollout import RolloutEngine, SamplingParams
from jetrl.rollout.sampling import to_device


@dataclass(frozen=True)
class PromptItem:
    """A tokenized prompt and the reference answer its reward is computed against."""

    ids: list[int]
    reference: str


class PromptSource(Protocol):
    """Where prompts come from: a fixed number per call, with a resumable position."""

    def next_batch(self) -> list[PromptItem]: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


# (completion texts, references) -> rewards, or a RewardResult (the reward pool's: rewards + per-sample status)
RewardFn = Callable[[list[str], list[str]], "Sequence[float] | RewardResult"]


def rollout_sampling_params(config: RunConfig) -> SamplingParams:
    """The rollout's sampling parameters from ``config.rollout`` (the trainer seeds them per prompt); a ValueError
    names what :class:`SamplingParams` refuses."""
    r = config.rollout
    return SamplingParams(n=r.n, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, max_tokens=r.max_tokens,
                          stop_token_ids=r.stop_token_ids, ignore_eos=r.ignore_eos)


def _seed_for(*parts: int) -> int:
    """A 31-bit seed mixed from integers (splitmix-style), stable across runs and platforms."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (int(p) & 0xFFFFFFFFFFFFFFFF)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFF


class Trainer:
    """Owns the policy's optimizer state and runs RL steps (see the module doc).

    Args:
        config: the run config (``algorithm``, ``rollout``, ``optim``, ``data.prompts_per_step``, ``exact``,
            ``recipe``/``kv_fp8``, ``trainer.seed`` and ``trainer.steps`` (the LR schedule's length) are read).
        model: the policy (a jetrl decoder with ``forward_packed``), already in its precision recipe.
        engine: a :class:`jetrl.rollout.RolloutEngine` over the same ``model``.
        prompts: a :class:`PromptSource` giving ``config.data.prompts_per_step`` prompts per call.
        reward_fn: ``(texts, references) -> rewards``; returning a
            :class:`~jetrl.data.reward_pool.RewardResult` also reports failed samples (``reward/errors``,
            ``reward/timeouts`` in the step's metrics).
        decode: token ids -> text, for the reward function.
        parallel: this process's rank in the job (:func:`jetrl.parallel.init_parallel`); None = one
            process. With several ranks the model and reference are sharded here with FSDP2 (the engine
            keeps working on the same, now sharded, module).
    """

    def __init__(self, config: RunConfig, model: nn.Module, engine: RolloutEngine, prompts: PromptSource,
                 reward_fn: RewardFn, decode: Callable[[list[int]], str], parallel: ParallelContext | None = None
                 ) -> None:
        self.config = config
        self.model = model
        self.engine = engine
        self.prompts = prompts
        self.reward_fn = reward_fn
        self.decode = decode
        self.device = next(model.parameters()).device
        self.parallel = parallel if parallel is not None else ParallelContext(device=self.device)
        self.update_logprobs: torch.Tensor | None = None  # set by update() when it records its own log-probs
        self.update_logprob_mask: torch.Tensor | None = None  # the tokens update() recorded them for
        alg, opt = config.algorithm, config.optim
        world = self.parallel.world_size
        if engine.exact != config.exact:
            raise ValueError(f"the run config has exact: {str(config.exact).lower()} but the rollout engine was built "
                             f"with exact={engine.exact}: build it with RolloutEngine(..., exact=config.exact), "
                             "or the rollout and the trainer compute log-probabilities differently")
        if config.data.prompts_per_step % world or config.mini_batch_size % world:
            raise ValueError(f"data.prompts_per_step ({config.data.prompts_per_step}) and the mini-batch "
                             f"({config.mini_batch_size} sequences) must be multiples of the number of ranks ({world})")
        restore_fp8_weights(model)  # a model an earlier trainer released: its values back before they are copied
        self.ref_model = None  # the frozen reference policy (the KL penalty's): a copy of the initial model
        if alg.kl_coef > 0:
            self.ref_model = copy.deepcopy(model)
            self.ref_model.requires_grad_(False).eval()
            shard_model(self.ref_model, self.parallel)
        shard_model(model, self.parallel)
        # the update as CUDA graphs where they apply (one CUDA device, fast mode): they need keep_grads below
        self.update_graphs = None
        if alg.cuda_graphs and graphs_apply(model, exact=config.exact, world_size=world) is None:
            self.update_graphs = UpdateGraphs(model, alg, temperature=config.rollout.temperature,
                                              kv_fp8=config.kv_fp8_train, max_len=config.rollout.max_tokens)
        self.optimizer = MasterWeightAdamW(model.parameters(), lr=opt.lr, betas=opt.betas, eps=opt.eps,
                                           weight_decay=opt.weight_decay, keep_grads=self.update_graphs is not None)
        self.released_weight_bytes = sum(layer.weight.numel() * layer.weight.element_size()
                                         for layer in fp8_linears(model) if layer.weight_released) \
            if release_fp8_weights(model, self.optimizer) else 0
        num_updates = config.trainer.steps * alg.ppo_epochs * (config.rollout_batch_size // config.mini_batch_size)
        self.scheduler = build_lr_scheduler(self.optimizer, opt.warmup_steps, max(1, num_updates), opt.schedule,
                                            opt.min_lr_ratio)
        self.stepper = OptimizerStepper(model, self.optimizer, self.scheduler, opt.grad_clip,
                                        opt.max_consecutive_nonfinite)
        self.step_count = 0

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable run state: step, data position, skip counters (model/optimizer go separately)."""
        return {"step": self.step_count, "data": self.prompts.state_dict(), "stepper": self.stepper.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step_count = int(state["step"])
        self.prompts.load_state_dict(state["data"])
        self.stepper.load_state_dict(state["stepper"])

    def rollout(self, items: list[PromptItem], first_index: int = 0) -> tuple[list[Any], float]:
        """``rollout.n`` completions per prompt (prompt-major), seeded per ``(trainer.seed, step, prompt)``
        where prompt ``i`` of ``items`` is prompt ``first_index + i`` of the step; runs on the full weights.
        Returns the completions and the number of generated tokens."""
        common = rollout_sampling_params(self.config)
        params = [replace(common, seed=_seed_for(self.config.trainer.seed, self.step_count, first_index + i))
                  for i in range(len(items))]
        with full_weights(self.model):
            completions = self.engine.generate([it.ids for it in items], params)
        return completions, float(sum(len(c.token_ids) for c in completions))

    def build_batch(self, items: list[PromptItem], completions: list[Any]) -> RolloutBatch:
        """Score the decoded completions (a reward function's failure counts too: see the class doc), compute
        advantages and lay the sequences out as a :class:`RolloutBatch` (mask, log-probs on the trainer's device)."""
        n = self.config.rollout.n
        prompts = [items[s // n] for s in range(len(completions))]  # each completion's prompt
        scored = self.reward_fn([self.decode(list(c.token_ids)) for c in completions], [p.reference for p in prompts])
        num_errors = num_timeouts = 0
        if isinstance(scored, RewardResult):
            num_errors, num_timeouts = scored.num_errors, scored.num_timeouts
            scored = scored.rewards
        rewards = torch.tensor([float(x) for x in scored], dtype=torch.float32)
        if rewards.numel() != len(completions):
            raise RuntimeError(f"the reward function returned {rewards.numel()} rewards for {len(completions)} "
                               f"completions")
        rewards = rewards.view(len(items), n)
        alg = self.config.algorithm
        # advantages over every rank's groups (a batch-level baseline sees the whole batch); keep ours
        first = self.parallel.rank * len(items)
        all_rewards = torch.cat(self.parallel.gather_objects(rewards))
        advantages = compute_advantages(all_rewards, alg.advantage_estimator, alg.std_normalize)
        advantages = advantages[first:first + len(items)].flatten()
        response_lens = [len(c.token_ids) for c in completions]
        mask = torch.zeros(len(completions), max(1, *response_lens), dtype=torch.bool)  # (S, R)
        rollout_lp = torch.zeros(mask.shape, dtype=torch.float32)
        for s, c in enumerate(completions):
            mask[s, :response_lens[s]] = True
            rollout_lp[s, :response_lens[s]] = torch.tensor(c.logprobs, dtype=torch.float32)
        tokens = [torch.tensor(list(p.ids) + list(c.token_ids), dtype=torch.long) for p, c in zip(prompts, completions)]
        return RolloutBatch(tokens, [len(p.ids) for p in prompts], response_lens, mask.to(self.device),
                            rollout_lp.to(self.device), rewards, advantages.to(self.device),
                            [c.finish_reason == "length" for c in completions], num_reward_errors=num_errors,
                            num_reward_timeouts=num_timeouts)

    def sequence_logprobs(self, model: nn.Module, batch: RolloutBatch, rows: Sequence[int]
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-probs and entropies (len(rows), R) of the response tokens of ``rows`` (0 past each response), one
        packed forward with the LM head on the response rows alone (:mod:`jetrl.rl.micro_batch`). Differentiable
        when grad is enabled. Exact mode: bitwise the engine's log-probs (the engine runs exact mode too); the FP8
        KV cache under ``jet``: attention over the K/V values the engine's FP8 cache held."""
        packed = pack(batch, rows, batch.mask.shape[1])
        # the ids are the engine's (prompts it checked against the vocabulary, tokens it sampled from it): neither
        # the forward nor the LM head syncs to check them; the index tensors go in one asynchronous copy
        return packed_logprobs(model, packed, to_device(packed.blob, self.device), self.config.rollout.temperature,
                               exact=self.config.exact, kv_fp8=self.config.kv_fp8_train)

    @torch.no_grad()
    def score(self, model: nn.Module, batch: RolloutBatch) -> torch.Tensor:
        """Training-side log-probs (S, R) of every response token, in micro-batches, no grad."""
        out = torch.zeros_like(batch.rollout_logprobs)
        graphs = self.update_graphs if model is self.model else None  # the policy's graphs; the reference: eager
        for rows in self._same_count_on_every_rank(self.micro_batches(batch, list(range(batch.num_sequences)))):
            if graphs is not None and graphs.failed is None:
                lp = graphs.score(graphs.pack(batch, rows), len(rows), batch.mask.shape[1])
            else:
                lp, _ = self.sequence_logprobs(model, batch, rows or [0])
            if rows is not None:
                out[to_device(torch.tensor(rows), self.device)] = lp.float()
        return torch.where(batch.mask, out, torch.zeros((), device=out.device))

    def micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[list[int]]:
        """Split ``rows`` into micro-batches: fixed size, or packed by token count. Packed, they are balanced
        (longest sequences first, each into the lightest micro-batch), starting from the fewest the budget could
        hold (total tokens / budget) and adding one until every micro-batch fits, so micro-batches have similar
        token counts (few CUDA-graph shapes, no small remainder); each keeps the order of ``rows``."""
        alg = self.config.algorithm
        if alg.max_tokens_per_micro_batch is None:
            size = alg.micro_batch_size
            return [rows[i:i + size] for i in range(0, len(rows), size)]
        budget = alg.max_tokens_per_micro_batch
        lens = {s: batch.tokens[s].numel() for s in rows}
        count = max(1, -(-sum(lens.values()) // budget))
        while True:
            bins: list[list[int]] = [[] for _ in range(count)]
            used = [0] * count
            for s in sorted(rows, key=lambda s: -lens[s]):  # stable: ties keep the order of rows
                i = min(range(count), key=used.__getitem__)
                bins[i].append(s)
                used[i] += lens[s]
            if max(used) <= budget or count >= len(rows):  # the config checks that one sequence fits the budget
                break
            count += 1
        position = {s: i for i, s in enumerate(rows)}
        return [sorted(b, key=position.__getitem__) for b in bins if b]

    def _same_count_on_every_rank(self, micros: list[list[int]]) -> list[list[int] | None]:
        """``micros`` padded with ``None`` to the largest count over ranks: a sharded forward gathers
        parameters collectively, so every rank must run as many. ``None`` = repeat a micro-batch for the
        collectives only (its result is discarded)."""
        most = int(self.parallel.max([len(micros)])[0])
        return micros + [None] * (most - len(micros))

    def _micro_step(self, batch: RolloutBatch, rows: list[int], mask: torch.Tensor, advantages: torch.Tensor,
                    inputs: dict[str, torch.Tensor | None], num_tokens: int, num_seqs: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, loss and backward of one micro-batch (the gradient accumulates into ``.grad``), as a CUDA graph
        replay where they apply (:mod:`jetrl.rl.update_graphs`), else eagerly; returns its log-probs (b, R),
        detached, and :func:`~jetrl.rl.micro_batch.micro_batch_loss`'s statistics."""
        if self.update_graphs is not None and self.update_graphs.failed is None:
            return self.update_graphs.run(self.update_graphs.pack(batch, rows), mask, advantages, inputs,
                                          num_tokens, num_seqs)
        lp, ent = self.sequence_logprobs(self.model, batch, rows)
        loss, stats = micro_batch_loss(self.config.algorithm, lp, ent, mask, advantages, num_tokens=num_tokens,
                                       num_seqs=num_seqs, max_len=self.config.rollout.max_tokens, **inputs)
        loss.backward()
        return lp.detach(), stats

    def update(self, batch: RolloutBatch, old_lp: torch.Tensor | None, ref_lp: torch.Tensor | None,
               is_weights: torch.Tensor | None, record_first: bool = False) -> dict[str, float]:
        """PPO epochs over shuffled mini-batches; one guarded optimizer step per mini-batch.

        ``old_lp`` None (``old_logprobs_from_update``, validated to mean a single optimizer step): each
        micro-batch's own log-probs, detached, are its old log-probs, and its TIS weights come from them;
        the (S, R) training-side log-probs are left in :attr:`update_logprobs` for the step's metrics.
        ``record_first`` (exact mode without the old_logprob pass) records the first mini-batch's log-probs,
        taken before the first optimizer step, the same way; :attr:`update_logprob_mask` marks the tokens
        recorded (every valid token when ``old_lp`` is None)."""
        alg = self.config.algorithm
        record = old_lp is None or record_first
        own_lp = torch.zeros_like(batch.rollout_logprobs) if record else None
        recorded = torch.zeros_like(batch.mask) if record else None
        world = self.parallel.world_size
        num_prompts = batch.num_sequences * world // self.config.rollout.n  # over every rank
        gen = torch.Generator().manual_seed(_seed_for(self.config.trainer.seed, self.step_count, 0xB17C4))
        names = stat_names(ref_lp is not None)
        # micro_batch_loss's inputs over the batch (without old log-probs, the TIS weights come from the rollout's)
        tis_rollout_lp = batch.rollout_logprobs if old_lp is None and alg.tis_cap is not None else None
        loss_inputs = dict(old_logprobs=old_lp, rollout_logprobs=tis_rollout_lp, is_weights=is_weights,
                           ref_logprobs=ref_lp)
        token_sums: dict[str, float] = {}  # the statistics weighted by their micro-batch's tokens, this rank's
        num_tokens_seen = 0.0
        step_sums = {"actor/pg_loss": 0.0, "actor/lr": 0.0}  # per optimizer step, the same on every rank
        ratio_max, ratio_min = -math.inf, math.inf
        grad_norms, num_applied = [], 0  # one grad norm per optimizer step (taken or skipped)
        self.model.train()
        for _ in range(alg.ppo_epochs):
            # mini-batch k is the same set of sequences at any number of ranks; this rank takes the ones it holds
            for rows in mini_batch_rows(num_prompts, self.config.rollout.n, self.config.mini_batch_size, gen,
                                        self.parallel.rank, world):
                m = batch.mask[rows]
                num_tokens = int(m.sum())
                num_seqs = int((m.sum(1) > 0).sum()) if alg.agg == "sequence" else len(rows)
                # the normalisers of the whole (global) mini-batch: the ranks' losses then add up to its loss
                num_tokens, num_seqs = (int(v) for v in self.parallel.sum([num_tokens, num_seqs]))
                stats = []  # per micro-batch, fetched in one transfer before the optimizer step
                micros = self.micro_batches(batch, rows)
                for micro in self._same_count_on_every_rank(micros):
                    if micro is None:  # the collectives of a forward/backward, no gradient
                        lp, _ = self.sequence_logprobs(self.model, batch, micros[0])
                        (lp.sum() * 0.0).backward()
                        continue
                    idx = to_device(torch.tensor(micro), self.device)  # one index tensor for every gather of this micro
                    mask = batch.mask[idx]
                    inputs = {k: None if v is None else v[idx] for k, v in loss_inputs.items()}
                    lp, micro_stats = self._micro_step(batch, micro, mask, batch.advantages[idx], inputs, num_tokens,
                                                       num_seqs)
                    if own_lp is not None and not grad_norms:  # no optimizer step yet: the rollout's policy
                        own_lp[idx] = torch.where(mask, lp.float(), torch.zeros((), device=lp.device))
                        recorded[idx] = mask
                    stats.append(micro_stats)
                loss_finite, mini_pg_loss = True, 0.0
                for values in (torch.stack(stats).tolist() if stats else []):
                    v = dict(zip(names, values))
                    for key in ("kl_ref", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "approx_kl",
                                "entropy"):
                        if key in v:
                            token_sums[key] = token_sums.get(key, 0.0) + v[key] * v["num_tokens"]
                    num_tokens_seen += v["num_tokens"]
                    loss_finite = loss_finite and bool(v["finite"])
                    mini_pg_loss += v["pg_loss"]
                    if v["num_tokens"] > 0:
                        ratio_max, ratio_min = max(ratio_max, v["ratio_max"]), min(ratio_min, v["ratio_min"])
                mini_pg_loss, num_nonfinite = self.parallel.sum([mini_pg_loss, 0.0 if loss_finite else 1.0])
                result = self.stepper.step(loss_is_finite=num_nonfinite == 0)
                step_sums["actor/pg_loss"] += mini_pg_loss
                step_sums["actor/lr"] += result.lr
                grad_norms.append(result.grad_norm)
                num_applied += result.applied
        *totals, num_tokens_seen = self.parallel.sum(list(token_sums.values()) + [num_tokens_seen])
        out = {f"actor/{k}": t / num_tokens_seen if num_tokens_seen else 0.0 for k, t in zip(token_sums, totals)}
        out.update({k: v / len(grad_norms) for k, v in step_sums.items()})
        ratio_max, neg_ratio_min = self.parallel.max([ratio_max, -ratio_min])
        out.update({k: (v if math.isfinite(v) else 1.0)  # 1.0: no token had a ratio
                    for k, v in (("actor/ratio_max", ratio_max), ("actor/ratio_min", -neg_ratio_min))})
        finite = [g for g in grad_norms if math.isfinite(g)]
        out["actor/grad_norm"] = sum(finite) / len(finite) if finite else float("nan")
        out["actor/num_updates"] = float(num_applied)
        out["actor/num_skipped_total"] = float(self.stepper.num_skipped)
        self.update_logprobs, self.update_logprob_mask = own_lp, recorded
        return out

    def step(self) -> dict[str, float]:
        """One RL step: the six phases of the module doc, each timed; returns its metrics (flat ``group/name``
        keys, see :func:`jetrl.rl.metrics.step_metrics`)."""
        alg = self.config.algorithm
        timer = PhaseTimer(self.device)
        items = self.prompts.next_batch()
        if not items:
            raise RuntimeError("the prompt source returned an empty batch")
        first, last = self.parallel.shard_bounds(len(items), "prompts per step")
        items = items[first:last]  # this rank's whole prompt groups
        self.model.eval()
        with timer.phase("rollout"):
            completions, generated = self.rollout(items, first)
        with timer.phase("reward"):
            batch = self.build_batch(items, completions)
        train_lp = old_lp = ref_lp = is_weights = checked = None
        skip_pass = self.config.exact and alg.use_rollout_logprobs  # the bypass of phase 3 (module doc)
        if skip_pass:
            old_lp = batch.rollout_logprobs
        elif not alg.old_logprobs_from_update:
            with timer.phase("old_logprob"):
                train_lp = self.score(self.model, batch)
            old_lp = batch.rollout_logprobs if alg.use_rollout_logprobs else train_lp
        if self.ref_model is not None:
            with timer.phase("reference"):
                ref_lp = self.score(self.ref_model, batch)
        if alg.tis_cap is not None and train_lp is not None:
            is_weights = truncated_is_weights(train_lp, batch.rollout_logprobs, batch.mask, alg.tis_cap)
        with timer.phase("update"):
            actor = self.update(batch, old_lp, ref_lp, is_weights, record_first=skip_pass)
        if train_lp is None:
            train_lp = self.update_logprobs
            if skip_pass:  # checked on the first mini-batch's tokens; the others keep the engine's (same) bits
                checked = self.update_logprob_mask
                train_lp = torch.where(checked, train_lp, batch.rollout_logprobs)
        with timer.phase("weight_refresh"):
            refresh_rollout_weights(self.model)
        self.step_count += 1
        batch, train_lp, ref_lp, generated, checked = self._global_view(batch, train_lp, ref_lp, generated, checked)
        timer.seconds = dict(zip(timer.seconds, self.parallel.max(list(timer.seconds.values()))))
        metrics = step_metrics(batch, train_lp, ref_lp, actor, timer.seconds, generated_tokens=generated,
                               ppo_epochs=alg.ppo_epochs, tis_cap=alg.tis_cap, checked=checked,
                               engine_stats=global_engine_stats(self.engine.last_stats, self.parallel))
        metrics.update(timer.memory_metrics())
        if self.device.type == "cuda":
            metrics["memory/fp8_weights_gib"] = fp8_weight_bytes(self.model) / 2 ** 30
            metrics["memory/released_bf16_weights_gib"] = self.released_weight_bytes / 2 ** 30
        if self.update_graphs is not None:  # over the run so far: captures stop once every shape has its graph
            metrics["update/graph_captures"] = float(self.update_graphs.captures)
            metrics["update/graph_replays"] = float(self.update_graphs.replays)
            metrics["update/graph_capture_seconds"] = self.update_graphs.capture_seconds
        if skip_pass and metrics["mismatch/logp_abs_diff_max"] != 0.0:  # the bypass's premise failed: say so
            warnings.warn(f"exact mode: the engine's log-probabilities differ from the trainer's (max |dlogp| "
                          f"{metrics['mismatch/logp_abs_diff_max']:.3g} on the checked tokens), but "
                          "use_rollout_logprobs took them as the old ones without truncated importance sampling; "
                          "set algorithm.use_rollout_logprobs: false to recompute them", RuntimeWarning, stacklevel=2)
        return metrics

    def _global_view(self, batch: RolloutBatch, train_lp: torch.Tensor, ref_lp: torch.Tensor | None,
                     generated: float, checked: torch.Tensor | None = None
                     ) -> tuple[RolloutBatch, torch.Tensor, torch.Tensor | None, float, torch.Tensor | None]:
        """The step's batch, log-probs, generated-token count and checked-token mask over every rank (rank
        order, on the CPU), for the metrics; unchanged on one rank."""
        if not self.parallel.is_distributed:
            return batch, train_lp, ref_lp, generated, checked
        mine = dict(vars(batch), train_lp=train_lp, ref_lp=ref_lp, generated=generated, checked=checked)
        parts = self.parallel.gather_objects({k: v.cpu() if torch.is_tensor(v) else v for k, v in mine.items()})

        def merge(key: str) -> Any:  # lists concatenated, counts summed, tensors concatenated in rank order
            values = [p[key] for p in parts]
            if values[0] is None:
                return None
            if isinstance(values[0], list):
                return [x for v in values for x in v]
            if not torch.is_tensor(values[0]):
                return sum(values)
            if values[0].dim() == 2:  # (S, R_rank) -> (S, R), zero-padded like a short row; rewards' (P, n) as is
                width = max(v.shape[1] for v in values)
                values = [torch.nn.functional.pad(v, (0, width - v.shape[1])) for v in values]
            return torch.cat(values)

        merged = RolloutBatch(**{f.name: merge(f.name) for f in fields(RolloutBatch)})
        return merged, merge("train_lp"), merge("ref_lp"), float(merge("generated")), merge("checked")


__all__ = ["Trainer", "PromptItem", "PromptSource", "RolloutBatch", "RewardFn"]
