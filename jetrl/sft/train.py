"""Supervised warm-start: train a decoder from scratch on a built-in task's worked solutions.

Each training sequence is ``<bos> prompt solution <eos>`` in the task's compact format; the loss is the
mean negative log-likelihood of the solution and ``<eos>`` tokens only (the prompt is given, not
learned), over all of a step's ``batch_size`` sequences. Examples are drawn by index from the task's
seeded generator (step ``s`` takes indices ``s * batch_size`` on), so a run never revisits an index and
never needs a stored data set; the evaluation set takes another seed. Independent draws can still repeat
a problem, within the training stream or across the two.

Two layouts of a step's sequences, the same loss (to fp32 rounding; a test checks it):

* **packed** (``packing=True``, the default on CUDA): the sequences are concatenated, in order, into
  packs of at most ``micro_batch_tokens`` tokens (:func:`pack_examples`); each pack is one
  ``model.forward_packed`` call with block-diagonal causal attention, so no compute goes to padding
  (long chains of very different lengths waste most of a padded batch). The packs are micro-batches:
  each adds ``sum of its NLL / step's target count`` to the gradients.
* **padded** (``packing=False``, the default elsewhere): right-padded to the longest sequence, one
  ``(B, T)`` causal batch (:func:`answer_loss`); for short sequences on CPU one batched attention call
  per layer is faster than the per-sequence varlen path.

Precision: ``dtype="bfloat16"`` trains BF16 parameters with fp32 master weights and moments
(:class:`jetrl.train.optim.MasterWeightAdamW`); the model stays in the ``bf16`` recipe, the warm start
every precision recipe of the experiments starts from. The result is a HuggingFace-format folder that
:func:`jetrl.models.load_model` and ``transformers`` load. The step budget is the early stop: the model
should be weak but not hopeless on its task, which leaves RL room to improve it.

Interruptions: every ``checkpoint_every`` steps (and after the last) the weights, the optimizer state
and the run state (the step, which is also the data position) go into ``<output_dir>/checkpoints/``
(:mod:`jetrl.train.checkpoint`); a resumed run ends with exactly the weights an uninterrupted run would
have. The folder is removed once the final model is written (unless ``keep_checkpoints``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from jetrl.progress import Progress
from jetrl.sft.tokenizer import save_char_tokenizer
from jetrl.train.checkpoint import (
    CHECKPOINT_SUBDIR, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint,
)
from jetrl.train.optim import LRSchedule, MasterWeightAdamW

SFT_METRICS_FILE = "sft_metrics.json"  # written beside the model: the run's config, loss history and accuracy
SFT_RECIPE = "bf16"  # the precision recipe SFT trains and evaluates in (no FP8): every recipe's warm start
SFT_DTYPES = ("float32", "bfloat16")  # training parameter and saved-weight dtypes (``dtype``, ``save_dtype``)


class SFTDiverged(RuntimeError):
    """The loss became NaN or infinite: the run stops (the learning rate is too high for the model)."""


@dataclass
class SFTConfig:
    """What to train on, the model's shape, the optimizer and the step budget.

    Linear sizes are multiples of 16. The FP8 GPU path runs any size: cuBLAS's blockwise GEMM takes K in multiples
    of 128 and N in multiples of 16 (of 128 against 128x128 weight scales), other shapes run on the Triton GEMM.
    ``train_seed`` and ``eval_seed`` pick different problem streams of the task (independent draws, not disjoint
    sets); ``difficulty`` is an int or a ``(low, high)`` range drawn per example."""

    output_dir: str = "tiny-arith"
    task: str = "arithmetic"
    difficulty: int | tuple[int, int] = 3
    train_seed: int = 1
    eval_seed: int = 12345
    eval_examples: int = 200
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 352
    max_position_embeddings: int = 512
    steps: int = 600
    batch_size: int = 64               # sequences per optimizer step
    lr: float = 3e-3
    min_lr_ratio: float = 0.1          # cosine decay floor
    warmup_steps: int | None = None    # None: min(50, steps // 10), so a short run still reaches lr and decays
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    seed: int = 0                      # weight init
    save_dtype: str = "float32"        # one of SFT_DTYPES
    log_every: int = 50
    device: str = "cpu"
    eval_every: int = 0                # > 0: greedy accuracy on the eval set every N steps (for tuning the budget)
    checkpoint_every: int = 100        # > 0: a resumable checkpoint every N steps and after the last; 0: none
    keep_checkpoints: bool = False     # keep <output_dir>/checkpoints after the final model is written
    packing: bool | None = None        # True: packed forwards; False: padded batches; None: packed on CUDA only
    micro_batch_tokens: int = 65536    # packing: at most this many tokens per forward (one micro-batch)
    dtype: str = "float32"             # training parameter dtype, one of SFT_DTYPES (bfloat16: fp32 master weights)

    def __post_init__(self) -> None:
        if self.warmup_steps is None and isinstance(self.steps, int):
            self.warmup_steps = min(50, self.steps // 10)
        if isinstance(self.difficulty, list):
            self.difficulty = tuple(self.difficulty)
        for name in ("steps", "batch_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "intermediate_size", "eval_examples", "log_every",
                     "micro_batch_tokens", "checkpoint_every"):
            value, low = getattr(self, name), 0 if name == "checkpoint_every" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"sft: {name} must be an int >= {low}, got {value!r}")
        if not 0 < self.lr < float("inf"):
            raise ValueError(f"sft: lr must be a finite number > 0, got {self.lr}")
        if self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("sft: warmup_steps must be >= 0 and min_lr_ratio in [0, 1]")
        for name in ("save_dtype", "dtype"):
            if getattr(self, name) not in SFT_DTYPES:
                raise ValueError(f"sft: {name} must be {' or '.join(map(repr, SFT_DTYPES))}, "
                                 f"got {getattr(self, name)!r}")
        if self.packing not in (None, True, False):
            raise ValueError(f"sft: packing must be True, False or None (auto), got {self.packing!r}")
        if self.train_seed == self.eval_seed:
            raise ValueError("sft: train_seed and eval_seed must differ (the evaluation problems must be unseen)")

    def uses_packing(self) -> bool:
        """Whether steps run packed (``packing``, or by default: on a CUDA device)."""
        return self.packing if self.packing is not None else torch.device(self.device).type == "cuda"

    def build_task(self, seed: int):
        from jetrl.data.tasks import get_task

        return get_task(self.task, difficulty=self.difficulty, seed=seed, style="compact")

    def model_config(self, tokenizer) -> dict[str, Any]:
        """The HF ``config.json`` dict of the Llama-style model (tied embeddings, vocab = tokenizer size)."""
        return {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": len(tokenizer),
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        }


@dataclass
class SFTResult:
    output_dir: str
    steps: int
    final_loss: float  # the loss's moving average (0.95 per step) at the last step, as the progress bar shows it
    accuracy: float
    num_parameters: int
    seconds: float


def encode_example(tokenizer, prompt: str, solution: str) -> tuple[list[int], int]:
    """``(<bos> prompt solution <eos> ids, number of prompt ids including <bos>)``."""
    prompt_ids = list(tokenizer.encode(prompt))
    solution_ids = list(tokenizer.encode(solution, add_special_tokens=False))
    return prompt_ids + solution_ids + [tokenizer.eos_token_id], len(prompt_ids)


def pad_batch(examples: list[tuple[list[int], int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(ids (B, T), targets (B, T))``: ``targets[b, i]`` is the next token when that token
    belongs to the solution (or is ``<eos>``), else -1 (prompt tokens and padding carry no loss)."""
    width = max(len(seq) for seq, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    targets = torch.full((len(examples), width), -1, dtype=torch.long)
    for b, (seq, prompt_len) in enumerate(examples):
        ids[b, :len(seq)] = torch.tensor(seq)
        targets[b, prompt_len - 1:len(seq) - 1] = torch.tensor(seq[prompt_len:])
    return ids, targets


def answer_loss(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the positions with a target (fp32 logits)."""
    logits = model(ids).float()
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-1)


@dataclass
class Pack:
    """Sequences concatenated into one row of tokens: ``input_ids``, ``positions`` and ``targets`` (N,)
    (``targets[i]`` is the next token when it is a solution token or ``<eos>``, else -1), and the
    sequence boundaries ``cu_seqlens`` (S+1 offsets, a host list)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: list[int]

    @property
    def num_targets(self) -> int:
        return int((self.targets >= 0).sum())

    def to(self, device: torch.device | str) -> "Pack":
        return Pack(self.input_ids.to(device), self.positions.to(device), self.targets.to(device), self.cu_seqlens)


def pack_examples(examples: list[tuple[list[int], int]], max_tokens: int) -> list[Pack]:
    """The ``(ids, prompt length)`` sequences, in order, greedily concatenated into packs of at most
    ``max_tokens`` tokens (a new pack starts when the next sequence does not fit). Same targets as
    :func:`pad_batch`, without the padding. A sequence longer than ``max_tokens`` is an error."""
    groups: list[list[tuple[list[int], int]]] = []
    used = 0
    for seq, prompt_len in examples:
        if len(seq) > max_tokens:
            raise ValueError(f"a sequence of {len(seq)} tokens does not fit a pack of {max_tokens} tokens; raise "
                             f"micro_batch_tokens")
        if not groups or used + len(seq) > max_tokens:
            groups.append([])
            used = 0
        groups[-1].append((seq, prompt_len))
        used += len(seq)
    packs = []
    for group in groups:
        ids, positions, targets, cu = [], [], [], [0]
        for seq, prompt_len in group:
            ids += seq
            positions += range(len(seq))
            # position i predicts token i + 1: targets on rows prompt_len - 1 .. len - 2
            targets += [-1] * (prompt_len - 1) + seq[prompt_len:] + [-1]
            cu.append(cu[-1] + len(seq))
        packs.append(Pack(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                          torch.tensor(targets, dtype=torch.long), cu))
    return packs


def packed_answer_loss(model: torch.nn.Module, pack: Pack) -> torch.Tensor:
    """Summed next-token negative log-likelihood (fp32) of a pack's target rows: one packed forward with
    block-diagonal causal attention, the LM head on the target rows only (chunked fp32 log-probabilities,
    :func:`jetrl.models.logprobs_from_hidden`)."""
    from jetrl.models import logprobs_from_hidden

    hidden = model.forward_packed(pack.input_ids, pack.positions, pack.cu_seqlens,
                                  max(b - a for a, b in zip(pack.cu_seqlens, pack.cu_seqlens[1:])))
    rows = (pack.targets >= 0).nonzero().squeeze(1)
    logprobs, _ = logprobs_from_hidden(model, hidden[rows], pack.targets[rows])
    return -logprobs.sum()


def lr_at(step: int, config: SFTConfig) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` (:class:`jetrl.train.optim.LRSchedule`)."""
    return config.lr * LRSchedule(config.warmup_steps, config.steps, "cosine", config.min_lr_ratio)(step)


# fields that may change between an interrupted run and its resume (they do not change the trained weights)
RESUMABLE_CHANGES = frozenset({"output_dir", "log_every", "eval_every", "eval_examples", "checkpoint_every",
                               "keep_checkpoints", "device"})


def format_duration(seconds: float) -> str:
    """``"42s"``, ``"3m05s"``, ``"1h02m"``: a compact duration for progress lines."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _check_same_run(saved: dict[str, Any], config: SFTConfig, path: str) -> None:
    current = json.loads(json.dumps(asdict(config)))  # as saved: tuples become lists
    # a saved key that is no longer a setting (an option since removed, e.g. task_options) shaped nothing now read
    changed = sorted(k for k in current if k not in RESUMABLE_CHANGES and saved.get(k) != current[k])
    if changed:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed)
        raise ValueError(f"sft: cannot resume from {path}: it was trained with other settings ({detail}); resume "
                         "with the same settings, or start a new run in another output_dir")


def run_sft(config: SFTConfig, progress: bool = True, log: Callable[[str], None] = print,
            resume: bool = False) -> SFTResult:
    """Train as configured and write the checkpoint, tokenizer and ``sft_metrics.json`` to ``output_dir``.

    ``resume``: continue from the newest complete checkpoint in ``<output_dir>/checkpoints`` (see the
    module doc); the settings that shape the weights must be unchanged. With nothing to resume, say so
    and start from step 0. Without ``resume``, an ``output_dir`` holding checkpoints is an error."""
    from jetrl.evaluate import evaluate
    from jetrl.models import build_model, save_model

    start = time.perf_counter()
    out = os.fspath(config.output_dir)
    ckpt_root = os.path.join(out, CHECKPOINT_SUBDIR)
    if not resume and list_checkpoints(ckpt_root):
        raise FileExistsError(f"sft: {ckpt_root} holds the checkpoints of an interrupted run; continue it with "
                              "resume (jetrl sft --resume), or delete that folder / choose another output_dir")
    os.makedirs(out, exist_ok=True)
    tokenizer = save_char_tokenizer(out)
    train_task = config.build_task(config.train_seed)
    torch.manual_seed(config.seed)
    model = build_model(config.model_config(tokenizer), dtype=getattr(torch, config.dtype), device=config.device,
                        recipe=SFT_RECIPE, seed=config.seed)
    model.source_path = out  # as a loaded model's: the tokenizer files are in place already, save_model copies none
    num_params = sum(p.numel() for p in model.parameters())
    optimizer = MasterWeightAdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.95),
                                  weight_decay=config.weight_decay)
    packing = config.uses_packing()
    history, loss_ema, first_step = [], None, 0
    if resume:
        path = latest_checkpoint(ckpt_root)  # verifies checksums; skips damaged ones with a warning
        if path is None:
            log(f"sft: nothing to resume in {ckpt_root}; starting from step 0")
        else:
            loaded = load_checkpoint(path, model=model, optimizer=optimizer, checksums=False)
            _check_same_run(loaded.trainer_state["config"], config, str(path))
            first_step, loss_ema = loaded.step, loaded.trainer_state["loss_ema"]
            history = loaded.trainer_state["history"]
            log(f"sft: resuming from {path} (step {first_step} of {config.steps})")
    eval_task = config.build_task(config.eval_seed)
    eval_set = eval_task.dataset(config.eval_examples)
    # a generation budget comfortably above the longest worked solution of the task's difficulty
    max_tokens = int(max(len(ex.solution) for ex in eval_task.examples(256)) * 1.5) + 8
    bar = Progress(config.steps, "sft", unit="step", enabled=progress)
    bar.update(first_step)
    loop_start = time.perf_counter()
    model.train()
    for step in range(first_step, config.steps):
        examples = [encode_example(tokenizer, ex.prompt, ex.solution)
                    for ex in train_task.examples(config.batch_size, start=step * config.batch_size)]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        optimizer.zero_grad()
        value = _backward_step_loss(model, examples, config, tokenizer.pad_token_id, packing, step)
        optimizer.gather_grads()  # into the fp32 masters (the parameters themselves when fp32)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(optimizer.masters, config.grad_clip))
        optimizer.step()
        loss_ema = value if loss_ema is None else 0.95 * loss_ema + 0.05 * value
        bar.update()
        bar.set_postfix(loss=f"{loss_ema:.3f}")
        if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
            history.append({"step": step + 1, "loss": value, "loss_ema": loss_ema, "lr": lr_at(step, config),
                            "grad_norm": grad_norm})
            if not progress:
                elapsed = time.perf_counter() - loop_start
                left = elapsed / (step + 1 - first_step) * (config.steps - step - 1)
                log(f"sft step {step + 1}/{config.steps}  loss {loss_ema:.4f}  {format_duration(elapsed)} elapsed, "
                    f"about {format_duration(left)} left")
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < config.steps:
            accuracy = evaluate(model, tokenizer, eval_set, max_tokens=max_tokens, reward_workers=0).accuracy
            history.append({"step": step + 1, "eval_greedy_accuracy": accuracy, "loss_ema": loss_ema})
            log(f"sft step {step + 1}: greedy accuracy {accuracy:.3f} on {config.eval_examples} unseen problems, "
                f"loss {loss_ema:.4f}")
        every = config.checkpoint_every
        if every and ((step + 1) % every == 0 or step + 1 == config.steps):
            save_checkpoint(ckpt_root, step + 1, model=model, optimizer=optimizer, keep_last=1,
                            trainer_state={"config": asdict(config), "loss_ema": loss_ema, "history": history})
    bar.close()

    model.eval()
    model.to(getattr(torch, config.save_dtype))  # keeps the Parameter objects: the optimizer's references stay valid
    if config.save_dtype == "float32":  # a BF16 run saved in fp32 keeps its fp32 master weights, not their rounding
        optimizer.sync_params_from_masters()
    save_model(model, out)
    result = evaluate(model, tokenizer, eval_set, max_tokens=max_tokens, progress=progress)
    seconds = time.perf_counter() - start
    summary = {"config": asdict(config), "num_parameters": num_params, "history": history,
               "eval": {"seed": config.eval_seed, "num_examples": config.eval_examples, "greedy_accuracy":
                        result.accuracy}, "seconds": seconds}
    with open(os.path.join(out, SFT_METRICS_FILE), "w") as f:
        json.dump(summary, f, indent=2)
    if not config.keep_checkpoints:
        shutil.rmtree(ckpt_root, ignore_errors=True)  # the final model is written: nothing left to resume
    return SFTResult(out, config.steps, float(loss_ema), result.accuracy, num_params, seconds)


def _backward_step_loss(model: torch.nn.Module, examples: list[tuple[list[int], int]], config: SFTConfig,
                        pad_id: int, packing: bool, step: int) -> float:
    """Back-propagate the step's mean answer NLL (packed micro-batches or one padded batch); its value."""
    if packing:
        packs = pack_examples(examples, config.micro_batch_tokens)
        num_targets = sum(pack.num_targets for pack in packs)
        # a generator: each micro-batch's graph is freed by its backward before the next forward
        losses = (packed_answer_loss(model, pack.to(config.device)) / num_targets for pack in packs)
    else:
        losses = [answer_loss(model, *(t.to(config.device) for t in pad_batch(examples, pad_id)))]
    total = 0.0
    for loss in losses:
        if not torch.isfinite(loss):
            raise SFTDiverged(f"sft: non-finite loss at step {step}; lower the learning rate")
        loss.backward()
        total += float(loss.detach())
    return total


@dataclass(frozen=True)
class ModelTask:
    """The task a ``jetrl sft`` model learned (:func:`model_task`): its name, difficulty, the task's compact prompt
    format in words, and an example prompt of the task's evaluation stream."""

    name: str
    difficulty: str
    compact_format: str
    example: str

    def describe(self) -> str:
        """For a user, in a line: the task, its difficulty and what a prompt is (without the example)."""
        form = f": {self.compact_format}" if self.compact_format else ""
        return f"trained by jetrl sft on the {self.name} task, difficulty {self.difficulty}{form}"


def model_task(model_dir: str | os.PathLike) -> ModelTask | None:
    """The task the model in ``model_dir`` learned, read from the ``sft_metrics.json`` that :func:`run_sft`
    wrote beside it (``jetrl generate`` shows it); None for a folder without a readable one (a model
    jetrl sft did not make)."""
    from jetrl.data.tasks import get_task

    try:
        with open(os.path.join(os.fspath(model_dir), SFT_METRICS_FILE)) as f:
            config = json.load(f)["config"]
        difficulty = config["difficulty"]  # an int, or a [low, high] list
        task = get_task(config["task"], difficulty=difficulty, seed=config["eval_seed"], style="compact")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    steps = "-".join(map(str, difficulty)) if isinstance(difficulty, list) else str(difficulty)
    return ModelTask(task.name, steps, task.compact_format, task.example(0).prompt.strip())


__all__ = ["SFT_DTYPES", "SFT_METRICS_FILE", "SFT_RECIPE", "SFTDiverged", "ModelTask", "model_task", "SFTConfig",
           "SFTResult", "run_sft", "encode_example", "pad_batch", "answer_loss", "Pack", "pack_examples",
           "packed_answer_loss", "lr_at", "format_duration"]
