"""The configuration of a whole run: a tree of dataclasses, validated before anything heavy happens.

Every section type-checks its fields on construction (coercing where a file or the command line gives a
string) and then runs its own range and cross-field checks, so an invalid run is reported before a model
is loaded (an unknown key, a wrong type or an out-of-range value without importing torch): a wrong type names
the expected type, and range or cross-field constraints (``clip_low < 0``, ``n < 1``, batch sizes that do not
divide) say which fields disagree. Every field is declared with :func:`setting`; a field that names an
implementation is checked against :func:`registered_names`. Reading files and ``--a.b=value`` overrides, and
writing a resolved config, is :mod:`jetrl.config.loader`'s job.

Batch sizes, in sequences (a sequence is one prompt plus one sampled completion)::

    rollout batch = data.prompts_per_step * rollout.n
    rollout batch  = k * algorithm.mini_batch_size      (one optimizer step per mini-batch, per PPO epoch)
    mini_batch_size = m * algorithm.micro_batch_size    (gradient accumulation), unless micro-batches are
                      packed by token count (algorithm.max_tokens_per_micro_batch)
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Sequence

from jetrl.config.choices import CHOICES


class ConfigError(ValueError):
    """A configuration value or key is invalid (raised before any model is loaded)."""


class ConfigTypeError(ConfigError, TypeError):
    """A configuration value has the wrong type."""


DTYPES = ("bfloat16", "float32", "float16")  # parameter dtypes of the policy (torch attribute names)
WEIGHTS_ONLY = ("none", "final", "all")  # trainer.weights_only: which checkpoints hold the policy only
ON_DISK_FULL = ("error", "skip")  # trainer.on_disk_full: too little free space for a checkpoint
_BOOL_WORDS = {**dict.fromkeys(("true", "yes", "on", "1"), True), **dict.fromkeys(("false", "no", "off", "0"), False)}


def registered_names(kind: str) -> list[str]:
    """The names a choice field takes, in the owning registry's order: ``kind`` is ``"recipe"``,
    ``"advantage_estimator"``, ``"kl_estimator"``, ``"loss_aggregation"`` or ``"lr_schedule"``.

    The RL stage's names are :data:`jetrl.config.choices.CHOICES` (its registries are built from them); the
    recipes are :data:`jetrl.quant.recipe.RECIPES`, a layer below, imported on first use (it imports torch).
    """
    if kind == "recipe":
        from jetrl.quant.recipe import RECIPES
        return list(RECIPES)
    if kind not in CHOICES:
        raise ValueError(f"no registry of {kind!r}")
    return list(CHOICES[kind])


def check_choice(key: str, value: str, choices: Sequence[str]) -> None:
    """A ConfigError unless ``value`` is one of ``choices``, naming the field ``key`` and the closest choice."""
    if value not in choices:
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key} must be one of {list(choices)}, got {value!r}{hint}")


def is_device(value: str) -> bool:
    """Whether ``value`` is a device string jetrl runs on: ``auto``, ``cpu``, ``cuda`` or ``cuda:N`` (torch rejects
    others, e.g. ``cuda:abc``, with a RuntimeError of its own)."""
    return re.fullmatch(r"auto|cpu|cuda(:\d+)?", value) is not None


def home_path(value: str | None) -> str | None:
    """``value`` with a leading ``~`` expanded to the home folder, as the shell would: ``--data.path=~/x`` reaches
    jetrl with the ``~`` (not at the start of the word), and a file may name a path so too."""
    return os.path.expanduser(value) if value and value.startswith("~") else value


def setting(default: Any, doc: str, registry: str | None = None) -> Any:
    """A config field: its default, its one-line meaning and, for a field whose value names an implementation,
    the registry that holds the valid names (``"recipe"``, ``"task"``, ...).

    The meaning and the registry are the field's metadata: the configuration reference
    (:mod:`jetrl.config.reference`, ``docs/configuration.md``) and ``jetrl config show`` read them from there."""
    return field(default=default, metadata={"doc": doc, "registry": registry})


class _Section:
    """Base of every config dataclass: type-checks its fields, then runs the section's own checks."""

    _name = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            object.__setattr__(self, f.name, coerce(getattr(self, f.name), hints[f.name], self._key(f.name)))
        self.validate()

    def validate(self) -> None:
        """Range and consistency checks of this section (overridden per section)."""

    def _key(self, name: str) -> str:
        return f"{self._name}.{name}" if self._name else name

    def _choice(self, name: str, choices: Sequence[str]) -> None:
        check_choice(self._key(name), getattr(self, name), choices)

    def _at_least(self, low: float, *names: str) -> None:
        """A ConfigError naming the first of the fields ``names`` that is below ``low`` (null is not)."""
        for name in names:
            value = getattr(self, name)
            if value is not None and value < low:
                raise ConfigError(f"{self._key(name)} must be >= {low}, got {value}")


@dataclass
class ModelConfig(_Section):
    """The policy checkpoint (a HuggingFace folder) and how to hold it."""

    _name = "model"
    path: str = setting("", "the policy: a HuggingFace checkpoint folder (config.json, *.safetensors, tokenizer), "
                        "or jetrl:tiny-arith")
    tokenizer: str | None = setting(None, "tokenizer folder; null: the one in `path`")
    dtype: str = setting("bfloat16", "parameter dtype of the policy (the optimizer keeps fp32 master state)",
                         registry="dtype")
    device: str = setting("auto", "auto (cuda when available, else cpu), cpu, cuda or cuda:N")
    gradient_checkpointing: bool = setting(False, "recompute each decoder block in the backward pass (less memory)")
    checkpoint_blocks: int | None = setting(None, "with gradient_checkpointing: recompute only the first N decoder "
                                            "blocks, the others keep their activations (more memory, less "
                                            "recomputation, the same gradients); null: every block")

    def validate(self) -> None:
        self.path, self.tokenizer = home_path(self.path), home_path(self.tokenizer)
        self._choice("dtype", DTYPES)
        self._at_least(0, "checkpoint_blocks")
        if self.checkpoint_blocks is not None and not self.gradient_checkpointing:
            raise ConfigError("model.checkpoint_blocks applies with model.gradient_checkpointing: true; set it, "
                              "or drop checkpoint_blocks")
        if not is_device(self.device):
            raise ConfigError(f"model.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")


@dataclass
class DataConfig(_Section):
    """Where prompts come from: a file (``path`` + ``format``) or a built-in task (``task``)."""

    _name = "data"
    path: str | None = setting(None, "prompt file, JSONL or Parquet (or set `task`)")
    format: str = setting("custom", "layout of the file at `path`: its columns, prompt template and reward",
                          registry="dataset_format")
    task: str | None = setting(None, "a built-in task instead of a file", registry="task")
    difficulty: int = setting(1, "built-in tasks: reasoning steps per problem")
    task_style: str = setting("compact", "built-in tasks: how a problem is asked: compact (bare symbols, the embedded "
                              "model's) or natural (an English instruction, for pretrained models)",
                              registry="task_style")
    num_examples: int = setting(10_000, "built-in tasks: problems generated from the trainer's seed")
    prompt_column: str | None = setting(None, "file column holding the prompt; null: the format's")
    answer_column: str | None = setting(None, "file column holding the reference answer; null: the format's")
    instruction: str | None = setting(None, "prompt template containing {prompt}; null: the format's")
    system_prompt: str | None = setting(None, "system message for chat templates; null: none")
    reward: str | None = setting(None, "reward function: a built-in name or package.module:function; null: the "
                                 "format's or task's", registry="reward")
    max_examples: int | None = setting(None, "files: use only the first N rows; null: all")
    eval_path: str | None = setting(None, "files: held-out prompts in the same format (e.g. GSM8K's test split) "
                                    "for the greedy accuracy jetrl train reports before and after training")
    prompts_per_step: int = setting(8, "prompts per RL step (each sampled rollout.n times)")
    shuffle: bool = setting(True, "shuffle the prompts every epoch")
    max_prompt_tokens: int = setting(512, "longest prompt in tokens; a longer one is an error, not truncated")

    def validate(self) -> None:
        self.path, self.eval_path = home_path(self.path), home_path(self.eval_path)
        # neither set is allowed while composing a config; the loop reports it before loading data
        if self.path is not None and self.task is not None:
            raise ConfigError(f"data.path ({self.path!r}) and data.task ({self.task!r}) are exclusive: set one")
        if self.eval_path is not None and self.task is not None:
            raise ConfigError(f"data.eval_path ({self.eval_path!r}) is for a run on a file; a built-in task's held-out "
                              f"problems are drawn with another seed: unset one")
        self._at_least(1, "prompts_per_step", "max_prompt_tokens", "difficulty", "num_examples", "max_examples")
        if self.instruction is not None and "{prompt}" not in self.instruction:
            raise ConfigError(f"data.instruction must contain '{{prompt}}', got {self.instruction!r}")


@dataclass
class RolloutConfig(_Section):
    """Sampling of ``n`` completions per prompt by the rollout engine."""

    _name = "rollout"
    n: int = setting(8, "completions sampled per prompt (the GRPO group size)")
    temperature: float = setting(1.0, "sampling temperature (> 0)")
    top_p: float = setting(1.0, "nucleus sampling: keep the smallest set of tokens with this much probability")
    top_k: int = setting(-1, "sample from the k most likely tokens; -1: all")
    max_tokens: int = setting(512, "new tokens per completion at most")
    stop_token_ids: tuple[int, ...] = setting((), "token ids that end a completion, besides the tokenizer's EOS")
    ignore_eos: bool = setting(False, "keep generating past EOS up to max_tokens (benchmarks)")
    decode_steps: int = setting(8, "decode steps the GPU runs back to back per host iteration (each step's "
                                "sampled tokens feed the next on the device); 1: the host between every step")
    progress: bool = setting(False, "show the rollout engine's own progress bar")
    memory_budget: float | None = setting(None, "KV cache size: a fraction of free GPU memory (<= 1) or bytes; "
                                          "null: the engine's default")

    def validate(self) -> None:
        self._at_least(1, "n", "max_tokens", "decode_steps")
        if self.memory_budget is not None and not self.memory_budget > 0:
            raise ConfigError(f"rollout.memory_budget must be > 0 (a fraction or bytes), got {self.memory_budget}")
        if not self.temperature > 0:
            raise ConfigError(f"rollout.temperature must be > 0 for RL sampling, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ConfigError(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ConfigError(f"rollout.stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)}")


@dataclass
class AlgorithmConfig(_Section):
    """Advantages, the clipped policy loss and its regularisers, and how a batch is split for updates."""

    _name = "algorithm"
    advantage_estimator: str = setting("grpo", "how rewards become advantages", registry="advantage_estimator")
    std_normalize: bool = setting(True, "divide advantages by the reward std: the group's under grpo (false: Dr. "
                                        "GRPO), the batch's under reinforce; rloo takes none")
    clip_low: float = setting(0.2, "PPO ratio clip below: 1 - clip_low")
    clip_high: float = setting(0.2, "PPO ratio clip above: 1 + clip_high (DAPO's clip-higher: e.g. 0.28)")
    agg: str = setting("token", "how per-token losses are averaged into the loss", registry="loss_aggregation")
    kl_coef: float = setting(0.0, "weight of the KL penalty to a frozen reference model (> 0 loads one, same "
                             "recipe)")
    kl_estimator: str = setting("k3", "estimator of that KL", registry="kl_estimator")
    entropy_coef: float = setting(0.0, "weight of the entropy bonus")
    tis_cap: float | None = setting(None, "truncated importance sampling: cap C (>= 1) of the rollout-to-trainer "
                                    "ratio weights; null: off")
    # this (verl's "bypass") and the next: where the old log-probs come from, phase 3 of jetrl.rl.trainer's doc
    use_rollout_logprobs: bool = setting(False, "take the rollout engine's log-probs as the old ones (in "
                                         "exact mode the old-logprob pass is then skipped)")
    old_logprobs_from_update: bool = setting(False, "take the old log-probs from the update's own forwards (needs "
                                             "ppo_epochs 1 and one mini-batch)")
    ppo_epochs: int = setting(1, "passes over the rollout batch per RL step")
    mini_batch_size: int | None = setting(None, "sequences per optimizer step; null: the whole rollout batch")
    micro_batch_size: int = setting(8, "sequences per forward/backward (when not packing by tokens)")
    max_tokens_per_micro_batch: int | None = setting(None, "pack micro-batches by token count, at most this many "
                                                     "tokens; null: by micro_batch_size")
    cuda_graphs: bool = setting(True, "replay the update's and the old-logprob pass's micro-batches as CUDA graphs, "
                                "one per padded shape (one CUDA device, fast mode; elsewhere eager)")

    def validate(self) -> None:
        self._choice("advantage_estimator", registered_names("advantage_estimator"))
        self._choice("agg", registered_names("loss_aggregation"))
        self._choice("kl_estimator", registered_names("kl_estimator"))
        self._at_least(0.0, "clip_low", "clip_high")
        if self.clip_low >= 1:
            raise ConfigError(f"algorithm.clip_low must be < 1 (the ratio's lower bound is 1 - clip_low), "
                              f"got {self.clip_low}")
        self._at_least(0.0, "kl_coef", "entropy_coef")
        self._at_least(1.0, "tis_cap")
        self._at_least(1, "ppo_epochs", "mini_batch_size", "micro_batch_size", "max_tokens_per_micro_batch")


@dataclass
class OptimConfig(_Section):
    """AdamW on fp32 master state, gradient clipping, learning-rate schedule, non-finite step handling."""

    _name = "optim"
    lr: float = setting(1e-6, "peak learning rate")
    betas: tuple[float, float] = setting((0.9, 0.999), "AdamW's beta1, beta2")
    eps: float = setting(1e-8, "AdamW's epsilon")
    weight_decay: float = setting(0.0, "AdamW's decoupled weight decay")
    warmup_steps: int = setting(0, "optimizer steps of linear warm-up from 0 to lr")
    schedule: str = setting("constant", "learning-rate decay after warm-up", registry="lr_schedule")
    min_lr_ratio: float = setting(0.0, "floor of the cosine/linear decay, as a fraction of lr")
    grad_clip: float | None = setting(1.0, "clip the global gradient norm to this; null: no clipping")
    max_consecutive_nonfinite: int = setting(3, "optimizer steps with a non-finite gradient skipped in a row "
                                             "before the run stops")

    def validate(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"optim.lr must be > 0, got {self.lr}")
        for i, b in enumerate(self.betas):
            if not 0 <= b < 1:
                raise ConfigError(f"optim.betas[{i}] must be in [0, 1), got {b}")
        if not self.eps > 0:
            raise ConfigError(f"optim.eps must be > 0, got {self.eps}")
        self._at_least(0.0, "weight_decay")
        self._at_least(0, "warmup_steps", "max_consecutive_nonfinite")
        self._choice("schedule", registered_names("lr_schedule"))
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(f"optim.grad_clip must be > 0 or null (off), got {self.grad_clip}")


@dataclass
class TrainerConfig(_Section):
    """Length of the run, seed, outputs, checkpointing and logging."""

    _name = "trainer"
    steps: int = setting(100, "RL steps")
    seed: int = setting(0, "seed of the prompt order, sampling and (built-in tasks) the problems")
    output_dir: str = setting("runs/jetrl", "folder of the run's metrics, checkpoints and plot")
    checkpoint_every: int = setting(50, "a checkpoint every N steps; 0: only the final one")
    keep_last: int = setting(2, "checkpoints kept (older ones are deleted)")
    log_every: int = setting(1, "write metrics every N steps")
    tensorboard: bool = setting(False, "also write TensorBoard events (when tensorboard is installed)")
    resume: bool = setting(False, "continue from the newest complete checkpoint (none: a warning, start at step 0)")
    # older jetrl versions wrote pickled .pt files; current checkpoints load with torch.load(weights_only=True)
    allow_pickle: bool = setting(False, "let resume unpickle old checkpoints (runs code: only ones you trust)")
    export_fp8: bool = setting(False, "also write each checkpoint's policy as block-FP8 (model_fp8/)")
    weights_only: str = setting("none", "checkpoints that hold the policy alone (its HuggingFace model/ folder, no "
                                "optimizer state: not resumable): none, the final one, or all")
    on_disk_full: str = setting("error", "too little free space for a checkpoint (estimated first): stop with an "
                                "error, or skip that checkpoint with a warning")
    num_threads: int | None = setting(None, "torch's CPU threads; null: OMP_NUM_THREADS when set, else half the cores, "
                                      "no more than the cores beside the reward workers")

    def validate(self) -> None:
        self.output_dir = home_path(self.output_dir)
        self._at_least(1, "steps", "num_threads", "keep_last", "log_every")
        self._at_least(0, "seed", "checkpoint_every")
        self._choice("weights_only", WEIGHTS_ONLY)
        self._choice("on_disk_full", ON_DISK_FULL)
        if not self.output_dir:
            raise ConfigError("trainer.output_dir must not be empty")


@dataclass
class DistributedConfig(_Section):
    """Several GPUs: launched with ``torchrun`` (one process without it is the one-rank case).

    The world size comes from torchrun; these settings shape the device mesh and the failure timeout.
    Each rank takes ``data.prompts_per_step / world_size`` whole prompt groups and ``mini_batch_size /
    world_size`` sequences of every mini-batch, so both must divide by the number of ranks (checked at
    launch, when the world size is known)."""

    _name = "distributed"
    # fewer than all ranks is HSDP: shard within groups of shard_size (a node), replicate across the groups
    shard_size: int | None = setting(None, "ranks sharing one copy of the weights (FSDP); null: all ranks")
    timeout_s: float = setting(600.0, "seconds a collective may wait (a dead or stuck rank) before the job fails")

    def validate(self) -> None:
        self._at_least(1, "shard_size")
        if not self.timeout_s > 0:
            raise ConfigError(f"distributed.timeout_s must be > 0, got {self.timeout_s}")


@dataclass
class RewardLimitsConfig(_Section):
    """When a failed reward stops the run (the reward function itself is ``data.reward``).

    A sample whose reward raises, times out, returns a non-number or a non-finite value, or (with
    ``max_abs``) a value of magnitude above ``max_abs``, scores 0.0 and is counted in ``reward/errors`` /
    ``reward/timeouts``; the run stops when at least ``stop_fraction`` of one step's samples failed (the
    default 1.0: when every sample failed, i.e. the reward function itself is broken)."""

    _name = "reward"
    max_abs: float | None = setting(None, "a reward of larger magnitude is a failure; null: any finite reward "
                                    "is accepted")
    stop_fraction: float = setting(1.0, "stop when at least this fraction of a step's samples failed, in (0, 1]")

    def validate(self) -> None:
        if self.max_abs is not None and not self.max_abs > 0:
            raise ConfigError(f"reward.max_abs must be > 0 or null (off), got {self.max_abs}")
        if not 0 < self.stop_fraction <= 1:
            raise ConfigError(f"reward.stop_fraction must be in (0, 1], got {self.stop_fraction}")


@dataclass
class RunConfig(_Section):
    """A whole RL run."""

    recipe: str = setting("jet", "precision recipe: what runs in FP8 on the rollout and the training side",
                          registry="recipe")
    exact: bool = setting(False, "exact on-policy mode: the rollout's log-probs equal the trainer's bit for bit "
                          "(bf16, jet)")
    # K and V stored as E4M3 with one power-of-two fp32 scale per token and KV head; under jet the training forward
    # attends over the same quantized K/V (fp8-rollout: the rollout side only, the comparison arm; bf16: an error)
    kv_fp8: bool = setting(False, "FP8 KV cache in the rollout engine (jet, fp8-rollout)")
    # KEY a field of jetrl.quant.kernels.tuning.KernelTuning (its family dataclasses' docs say what each does); on
    # the command line --kernels=exact_split_k=1,...
    kernels: tuple[str, ...] = setting((), "kernel settings for the whole run, KEY=VALUE, e.g. [exact_split_k=1]",
                                       registry="kernel_setting")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardLimitsConfig = field(default_factory=RewardLimitsConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    @property
    def rollout_batch_size(self) -> int:
        """Sequences per RL step: prompts x samples."""
        return self.data.prompts_per_step * self.rollout.n

    @property
    def kv_fp8_train(self) -> bool:
        """Whether the training forward quantizes K and V like the FP8 KV cache (``kv_fp8`` under a recipe that
        trains in FP8, i.e. ``jet``); under ``fp8-rollout`` the FP8 cache is the rollout's alone."""
        from jetrl.quant.recipe import kv_fp8_train

        return kv_fp8_train(self.recipe, self.kv_fp8)

    @property
    def kernel_settings(self) -> dict:
        """``kernels`` as the fields :func:`jetrl.quant.kernels.tuning.override` takes (typed and checked)."""
        from jetrl.quant.kernels.tuning import parse_settings

        return parse_settings(self.kernels, "kernels")

    @property
    def mini_batch_size(self) -> int:
        """Sequences per optimizer step (the whole rollout batch unless ``algorithm.mini_batch_size``)."""
        return self.algorithm.mini_batch_size or self.rollout_batch_size

    def check_complete(self) -> None:
        """What a run needs beyond :meth:`validate` (which a config still being composed must pass): prompts
        (``data.path`` or ``data.task``) and a policy (``model.path``); a ConfigError names the missing one."""
        if self.data.path is None and self.data.task is None:
            raise ConfigError("no prompts: set data.path (a JSONL/Parquet file) or data.task (a built-in task)")
        if not self.model.path:
            raise ConfigError("model.path is empty: point it at a HuggingFace checkpoint folder")

    def validate(self) -> None:
        self._choice("recipe", registered_names("recipe"))
        if self.kernels:
            try:
                self.kernel_settings
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if self.exact:
            from jetrl.quant.recipe import get_recipe

            recipe = get_recipe(self.recipe)
            if recipe.rollout_fp8 != recipe.train_fp8:
                raise ConfigError(f"exact: true needs one precision on the rollout and training sides (recipe bf16 or "
                                  f"jet); recipe {self.recipe!r} rolls out in FP8 and trains in BF16, so the "
                                  f"rollout's log-probabilities cannot equal the trainer's")
        if self.kv_fp8:
            from jetrl.quant.recipe import kv_fp8_train

            try:
                kv_fp8_train(self.recipe, True)
            except ValueError as exc:
                raise ConfigError(f"kv_fp8: true is not valid with recipe {self.recipe!r}: {exc}; or set "
                                  f"kv_fp8: false") from None
        alg = self.algorithm
        if self.rollout_batch_size % self.mini_batch_size:
            raise ConfigError(
                f"the rollout batch (data.prompts_per_step * rollout.n = {self.data.prompts_per_step} * "
                f"{self.rollout.n} = {self.rollout_batch_size} sequences) must be divisible by "
                f"algorithm.mini_batch_size ({self.mini_batch_size})")
        if alg.max_tokens_per_micro_batch is None and self.mini_batch_size % alg.micro_batch_size:
            raise ConfigError(
                f"the mini-batch ({self.mini_batch_size} sequences) must be divisible by "
                f"algorithm.micro_batch_size ({alg.micro_batch_size})")
        longest = self.data.max_prompt_tokens + self.rollout.max_tokens
        if alg.max_tokens_per_micro_batch is not None and alg.max_tokens_per_micro_batch < longest:
            raise ConfigError(
                f"algorithm.max_tokens_per_micro_batch ({alg.max_tokens_per_micro_batch}) must hold the "
                f"longest sequence (data.max_prompt_tokens + rollout.max_tokens = {longest})")
        if alg.old_logprobs_from_update:
            if alg.use_rollout_logprobs:
                raise ConfigError("algorithm.old_logprobs_from_update and algorithm.use_rollout_logprobs both choose "
                                  "where the old log-probs come from; set one of them")
            if alg.ppo_epochs != 1 or self.mini_batch_size != self.rollout_batch_size:
                minis = self.rollout_batch_size // self.mini_batch_size
                raise ConfigError(
                    "algorithm.old_logprobs_from_update needs one optimizer step per RL step (ppo_epochs = 1 and "
                    f"one mini-batch), got ppo_epochs = {alg.ppo_epochs} and {minis} mini-batches: after the "
                    "first step the policy has moved, so later forwards are not the old policy")
        if alg.advantage_estimator in ("grpo", "rloo") and self.rollout.n < 2:
            # a group of one sample has advantage 0: the run would go its whole length and learn nothing
            raise ConfigError(f"algorithm.advantage_estimator={alg.advantage_estimator!r} needs rollout.n >= 2 (its "
                              f"baseline is the prompt's group: one sample gives advantage 0, so nothing is learned); "
                              f"raise rollout.n, or use 'reinforce' (a batch-mean baseline)")


# ------------------------------------------------------------------------------------------------ typing

def is_section_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def coerce(value: Any, tp: Any, key: str, from_string: bool = False) -> Any:
    """Check ``value`` against the annotation ``tp`` (parsing it from a string when ``from_string``)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        # the strings "none"/"null" mean None on the command line, and in files for non-string fields
        # (TOML has no null)
        is_null_word = isinstance(value, str) and value.lower() in ("none", "null")
        if value is None or (is_null_word and (from_string or inner[0] is not str)):
            if type(None) in args:
                return None
            raise ConfigTypeError(f"{key} must not be null")
        return coerce(value, inner[0], key, from_string)
    if is_section_type(tp):
        if isinstance(value, tp):
            return value
        if isinstance(value, dict):
            return from_dict(tp, value, key)
        raise ConfigTypeError(f"{key} must be a section (a mapping of keys), got {type(value).__name__}")
    if origin is tuple:
        if from_string and isinstance(value, str):
            text = value.strip().strip("[]()")
            value = [v.strip() for v in text.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise ConfigTypeError(f"{key} must be a list, got {type(value).__name__} ({value!r})")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], f"{key}[{i}]", from_string) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigTypeError(f"{key} must have {len(args)} elements, got {len(value)} ({value!r})")
        return tuple(coerce(v, a, f"{key}[{i}]", from_string) for i, (v, a) in enumerate(zip(value, args)))
    if tp is bool:
        if isinstance(value, bool):
            return value
        if from_string and isinstance(value, str) and value.lower() in _BOOL_WORDS:
            return _BOOL_WORDS[value.lower()]
        raise ConfigTypeError(f"{key} must be a bool (true/false), got {type(value).__name__} ({value!r})")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_string and isinstance(value, str):
            with contextlib.suppress(ValueError):
                return int(value.replace("_", ""))
        raise ConfigTypeError(f"{key} must be an int, got {type(value).__name__} ({value!r})")
    if tp is float:  # a string too: "1e-6" is a string to YAML 1.1 parsers, so accept float literals
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ConfigTypeError(f"{key} must be a number, got {type(value).__name__} ({value!r})")
        try:
            value = float(value)
        except ValueError:  # only a string that is no float literal
            raise ConfigTypeError(f"{key} must be a number, got str ({value!r})") from None
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be finite, got {value}")
        return value
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigTypeError(f"{key} must be a string, got {type(value).__name__} ({value!r})")
    raise ConfigTypeError(f"{key}: unsupported config field type {getattr(tp, '__name__', tp)}")


def field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def unknown_key_error(key: str, valid: Sequence[str], prefix: str) -> ConfigError:
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.5)
    full = f"{prefix}.{key}" if prefix else key
    hint = f"; did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else ""
    return ConfigError(f"unknown config key '{full}'{hint} (valid keys here: {', '.join(valid)})")


def from_dict(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build the dataclass ``cls`` from a nested mapping, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise ConfigTypeError(f"{prefix or 'the config'} must be a mapping, got {type(data).__name__}")
    known = field_types(cls)
    for key in data:
        if key not in known:
            raise unknown_key_error(str(key), list(known), prefix)
    return cls(**{k: coerce(v, known[k], f"{prefix}.{k}" if prefix else k) for k, v in data.items()})


def to_dict(config: Any) -> dict[str, Any]:
    """The config as plain nested dicts/lists/scalars (tuples become lists)."""
    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        return v
    return plain(config)


__all__ = [
    "ConfigError", "ConfigTypeError", "RunConfig", "ModelConfig", "DataConfig", "RewardLimitsConfig", "RolloutConfig",
    "AlgorithmConfig", "OptimConfig", "TrainerConfig", "DistributedConfig", "from_dict", "to_dict", "registered_names",
    "DTYPES", "WEIGHTS_ONLY", "ON_DISK_FULL", "check_choice", "is_device", "home_path", "setting",
]
