"""The optimizer side of a training step (RL and SFT): AdamW on fp32 master state, clipping, LR schedule,
non-finite guard.

**Master weights.** RL updates are tiny (learning rates around 1e-6), far below the resolution of a BF16
weight (8 mantissa bits: a relative step of 2^-8), so applying AdamW directly to BF16 parameters would
round most updates away. :class:`MasterWeightAdamW` therefore keeps an fp32 master copy of every
non-fp32 parameter, runs ``torch.optim.AdamW`` (fp32 moments) on the masters and writes the rounded
result back into the BF16 parameters, which the model computes with (and ``FP8Linear`` quantizes), after
each step; fp32 parameters are optimised in place. Memory per BF16 parameter: 2 (param) + 4 (master) + 8
(moments) bytes; under ``jet`` :func:`release_fp8_weights` drops the BF16 copy the FP8 linears do not read.

**One guarded step.** :class:`OptimizerStepper` copies gradients to the masters, clips the global norm,
and applies the step only if the loss and the gradient norm are finite. A non-finite step is skipped (no
parameter, moment or LR-schedule change), counted, and after more than ``max_consecutive_nonfinite`` skips
in a row the run stops with :class:`NonFiniteError`. After every applied step the FP8 weights are refreshed
(:func:`jetrl.quant.refresh_fp8_weights`) so that the next forward (the next mini-batch's or the rollout's)
quantizes the new weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from jetrl.config.choices import CHOICES
from jetrl.quant import FP8Linear, refresh_fp8_weights


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class MasterWeightAdamW:
    """AdamW with fp32 master weights and moments for low-precision parameters (see module doc).

    Weight decay applies to matrices (``ndim >= 2``) only, not to norms and biases. The learning-rate
    scheduler attaches to :attr:`inner` (a real ``torch.optim.AdamW``). ``keep_grads``: the parameters' ``.grad``
    buffers are zeroed in place instead of dropped, so their addresses stay fixed (the update's CUDA graphs
    accumulate into them); they then take their memory at the step's peak too."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 1e-6, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, keep_grads: bool = False) -> None:
        self.keep_grads = bool(keep_grads)
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("MasterWeightAdamW got no trainable parameters")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("MasterWeightAdamW got the same parameter twice (tied weights: pass model.parameters())")
        placeholders = [p for p in self.params if _released(p)]
        if placeholders:
            raise ValueError(f"{len(placeholders)} parameters are placeholders of FP8 weights whose values live in "
                             f"another optimizer's masters (release_fp8_weights): call "
                             f"jetrl.train.optim.restore_fp8_weights(model) before building a new optimizer")
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
                        for p in self.params]
        decay = [m for p, m in zip(self.params, self.masters) if p.ndim >= 2]
        no_decay = [m for p, m in zip(self.params, self.masters) if p.ndim < 2]
        groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        # CPU: foreach=False, one parameter at a time, so CPU runs are bitwise reproducible across resume; CUDA:
        # the multi-tensor kernels (a few launches for all parameters instead of several per parameter)
        cuda = self.params[0].device.type == "cuda"
        self.inner = torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=cuda)
        self._released: set[int] = set()  # ids of parameters whose values live in their masters alone

    def release(self, p: nn.Parameter) -> torch.Tensor:
        """Stop writing ``p`` from its master after each step (its owner reads the master itself: an FP8 layer
        that dropped its BF16 weight, :func:`release_fp8_weights`); returns the master."""
        for q, m in zip(self.params, self.masters):
            if q is p:
                if m is p:
                    raise ValueError("an fp32 parameter is its own master: nothing to release")
                self._released.add(id(p))
                return m
        raise KeyError(f"a parameter of shape {tuple(p.shape)} is not optimized here")

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters):
            if self.keep_grads and p.grad is not None:
                p.grad.zero_()
            else:
                p.grad = None
            if m is not p:
                m.grad = None

    @torch.no_grad()
    def gather_grads(self) -> list[torch.Tensor]:
        """Copy the parameters' gradients into fp32 master gradients; returns those gradients."""
        grads = []
        for p, m in zip(self.params, self.masters):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
                if not self.keep_grads:
                    p.grad = None  # the fp32 copy replaces it: 2 bytes per parameter less at the step's peak
            if m.grad is not None:
                grads.append(m.grad)
        return grads

    @torch.no_grad()
    def step(self) -> None:
        """AdamW on the masters (call :meth:`gather_grads` first), then masters -> parameters."""
        self.inner.step()
        self.sync_params_from_masters()

    def state_by_name(self, names: dict[int, str]) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer's tensors per parameter name: ``{name: {"exp_avg", "exp_avg_sq", "step"[,
        "master"]}}``, the live tensors (sharded DTensors stay sharded), for
        :func:`jetrl.parallel.save_sharded` / ``load_sharded`` (which loads into them in place; call
        :meth:`sync_params_from_masters` after a load). ``names`` maps ``id(parameter)`` to its name
        (``{id(p): n for n, p in model.named_parameters()}``). The AdamW state is created first if no
        step has run yet (zero moments at step 0: the same as a fresh optimizer)."""
        out = {}
        for p, m in zip(self.params, self.masters):
            if id(p) not in names:
                raise KeyError(f"an optimized parameter of shape {tuple(p.shape)} has no name in the model")
            state = self.inner.state[m]
            if not state:
                state.update(step=torch.zeros((), dtype=torch.float32), exp_avg=torch.zeros_like(m),
                             exp_avg_sq=torch.zeros_like(m))
            entry = {"exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"], "step": state["step"]}
            if m is not p:
                entry["master"] = m
            out[names[id(p)]] = entry
        return out

    @torch.no_grad()
    def sync_params_from_masters(self) -> None:
        """Round the fp32 masters into the parameters (after each step, or after the masters were loaded in place);
        released ones read their masters already."""
        for p, m in zip(self.params, self.masters):
            if m is not p and id(p) not in self._released:
                p.copy_(m)  # rounds to the parameter dtype; bumps the version FP8Linear's cache is keyed on

    def state_dict(self) -> dict[str, Any]:
        masters = {i: m.detach().clone() for i, (p, m) in enumerate(zip(self.params, self.masters)) if m is not p}
        return {"adamw": self.inner.state_dict(), "masters": masters}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["adamw"])
        for i, saved in state["masters"].items():
            i = int(i)
            if self.masters[i] is self.params[i] or tuple(saved.shape) != tuple(self.masters[i].shape):
                raise ValueError(f"optimizer checkpoint does not match the model at parameter #{i}")
            self.masters[i].copy_(saved)
            if id(self.params[i]) not in self._released:
                self.params[i].copy_(saved)


LR_SCHEDULES = CHOICES["lr_schedule"]  # the decay after warm-up (config: optim.schedule)


class LRSchedule:
    """LR multiplier per applied optimizer step: linear warm-up, then constant / cosine / linear decay.

    Step ``s`` (0-based) during warm-up gets ``(s + 1) / warmup_steps``, so the first step is not 0.
    After warm-up, ``progress = (s - warmup) / (total - warmup)`` in [0, 1] decays the factor from 1 to
    ``min_lr_ratio``. A picklable object (not a lambda) so that ``LambdaLR.state_dict`` carries it."""

    def __init__(self, warmup_steps: int, total_steps: int, schedule: str = "constant", min_lr_ratio: float = 0.0):
        if schedule not in LR_SCHEDULES:
            raise ValueError(f"unknown LR schedule {schedule!r}; choose one of {LR_SCHEDULES}")
        if warmup_steps < 0 or total_steps < 1:
            raise ValueError(f"need warmup_steps >= 0 and total_steps >= 1, got {warmup_steps}, {total_steps}")
        self.warmup_steps, self.total_steps = warmup_steps, total_steps
        self.schedule, self.min_lr_ratio = schedule, min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.schedule == "cosine" else 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


def build_lr_scheduler(optimizer: MasterWeightAdamW, warmup_steps: int, total_steps: int, schedule: str = "constant",
                       min_lr_ratio: float = 0.0) -> torch.optim.lr_scheduler.LambdaLR:
    """A ``LambdaLR`` on ``optimizer.inner`` driven by :class:`LRSchedule`, stepped once per applied optimizer step."""
    factor = LRSchedule(warmup_steps, total_steps, schedule, min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer.inner, factor)


@dataclass
class StepResult:
    """What one :meth:`OptimizerStepper.step` did."""

    applied: bool
    grad_norm: float          # before clipping; nan/inf when the step was skipped for that reason
    lr: float                 # the learning rate the step used (or would have used)
    num_skipped: int          # skipped steps so far in the run
    num_consecutive_skipped: int


class OptimizerStepper:
    """Clip, guard against non-finite values, step, schedule, refresh FP8 weights (see module doc)."""

    def __init__(self, model: nn.Module, optimizer: MasterWeightAdamW,
                 scheduler: torch.optim.lr_scheduler.LRScheduler | None = None, grad_clip: float | None = 1.0,
                 max_consecutive_nonfinite: int = 3) -> None:
        if (grad_clip is not None and not grad_clip > 0) or max_consecutive_nonfinite < 0:
            raise ValueError(f"need grad_clip > 0 or None and max_consecutive_nonfinite >= 0, got {grad_clip} and "
                             f"{max_consecutive_nonfinite}")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.grad_clip, self.max_consecutive_nonfinite = grad_clip, max_consecutive_nonfinite
        self.num_skipped = self.num_consecutive_skipped = 0

    def step(self, loss_is_finite: bool = True) -> StepResult:
        """Apply the accumulated gradients (or skip them); always leaves the gradients cleared."""
        lr = float(self.optimizer.param_groups[0]["lr"])
        grads = self.optimizer.gather_grads()
        norm = clip_grad_norm(grads, self.grad_clip)
        if not (loss_is_finite and math.isfinite(norm)):
            self.optimizer.zero_grad()
            self.num_skipped += 1
            self.num_consecutive_skipped += 1
            if self.num_consecutive_skipped > self.max_consecutive_nonfinite:
                what = "loss" if not loss_is_finite else f"gradient norm ({norm})"
                raise NonFiniteError(
                    f"{self.num_consecutive_skipped} optimizer steps in a row had a non-finite {what} "
                    f"(allowed: optim.max_consecutive_nonfinite={self.max_consecutive_nonfinite}); stopping. "
                    f"Lower optim.lr, check the rewards and inputs, or resume from the last checkpoint.")
            return StepResult(False, norm, lr, self.num_skipped, self.num_consecutive_skipped)
        self.optimizer.step()
        self.optimizer.zero_grad()
        if self.scheduler is not None:
            self.scheduler.step()
        refresh_fp8_weights(self.model)
        self.num_consecutive_skipped = 0
        return StepResult(True, norm, lr, self.num_skipped, 0)

    def state_dict(self) -> dict[str, int]:
        return {"num_skipped": self.num_skipped, "num_consecutive_skipped": self.num_consecutive_skipped}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.num_skipped = int(state["num_skipped"])
        self.num_consecutive_skipped = int(state["num_consecutive_skipped"])


@torch.no_grad()
def clip_grad_norm(grads: list[torch.Tensor], max_norm: float | None) -> float:
    """Global L2 norm of ``grads`` (fp32 accumulation; over all ranks for sharded DTensor gradients);
    scales them in place to ``max_norm`` if above it and finite. Returns the norm before clipping (a host
    sync: the step needs the decision anyway)."""
    if not grads:
        return 0.0
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    if isinstance(total, DTensor):  # FSDP-sharded gradients: the norm over every rank's slices
        total = total.full_tensor()
    norm = float(total)
    if max_norm is not None and math.isfinite(norm) and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        for g in grads:
            g.mul_(scale)
    return norm


def _released(p: torch.Tensor) -> bool:
    """Whether ``p`` is the placeholder of a released FP8 weight (no storage for its values)."""
    return p.numel() > 1 and p.untyped_storage().nbytes() < p.numel() * p.element_size()


def restore_fp8_weights(model: nn.Module) -> int:
    """Undo :func:`release_fp8_weights` on ``model`` (each released layer's weight holds its values again), so that a
    new optimizer can start its masters from them. Returns the number of layers restored."""
    layers = [layer for layer in model.modules() if isinstance(layer, FP8Linear) and layer.weight_released]
    for layer in layers:
        layer.restore_weight()
    return len(layers)


def release_fp8_weights(model: nn.Module, optimizer: MasterWeightAdamW) -> int:
    """Drop the BF16 weights of ``model``'s FP8 linears that run FP8 on both sides (``jet``): each then quantizes its
    FP8 weight from its fp32 master in ``optimizer`` (:meth:`jetrl.quant.FP8Linear.release_weight`), the same bytes,
    and the BF16 copy, read by nothing else, no longer takes 2 bytes per parameter. That pays for the FP8 copy of
    the weights (1 byte per parameter). Unsharded weights only (a sharded model gathers its BF16 weights to
    quantize them), of 16-bit dtypes (an fp32 weight is its own master). Returns the number of layers released."""
    released = 0
    for layer in model.modules():
        w = layer.weight if isinstance(layer, FP8Linear) else None
        if w is not None and layer.fp8_train and layer.fp8_rollout and not layer.weight_released \
                and w.requires_grad and w.dtype != torch.float32 and type(w.data) is torch.Tensor:
            layer.release_weight(optimizer.release(layer.weight))
            released += 1
    return released


__all__ = ["MasterWeightAdamW", "LRSchedule", "build_lr_scheduler", "OptimizerStepper", "StepResult",
           "NonFiniteError", "clip_grad_norm", "release_fp8_weights", "restore_fp8_weights"]
