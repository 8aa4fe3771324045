"""Sampling parameters and the batched sampler: one token AND its log-probability per row, on the device.

**Which log-probability.** The sampler returns ``log_softmax(logits / T)[token]`` computed in fp32 over
the *whole* vocabulary, *before* top-k/top-p truncation (for greedy rows, T = 0, it is
``log_softmax(logits)[token]``, i.e. temperature 1). The trainer computes the same quantity
(``jetrl.models.token_logprobs(..., temperature=T)``), so rollout and training log-probabilities agree
by definition, and truncation never produces a log-probability the trainer cannot reproduce from the
logits alone. Tokens are *drawn* from the truncated, renormalised distribution.

**Truncation order** (vLLM's): top-k first (keep the k largest logits), then top-p on the renormalised
top-k distribution (keep the smallest prefix of tokens, by decreasing probability, whose mass reaches
``top_p``; the most likely token is always kept).

**Randomness.** Sampling is Gumbel-max: ``argmax(logits / T + g)`` over the kept tokens, with ``g`` i.i.d.
standard Gumbel noise, which draws exactly from the truncated softmax. For seeded requests ``g`` comes from
a counter-based hash of ``(seed, sample index, output position, token id)``: a sample's tokens depend only
on its own seed and history, never on the batch it ran in, the order of requests, or a preemption in
between (recomputed sequences resume the same noise stream). Unseeded rows draw from the global torch
generator of the logits' device (cheaper; not reproducible across batch compositions).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from jetrl.quant.backend import choose_impl

# the smallest non-zero temperature (vLLM's sampling epsilon): logits / temperature stays finite in float32 for
# any logit a model gives, so the log-probs of rollout and trainer do
MIN_TEMPERATURE = 1e-5

_MASK32 = 0xFFFFFFFF


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` copied to ``device`` without a host sync: on CUDA from pinned memory (a copy from pageable memory
    waits for the work already queued)."""
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"SamplingParams.{name} must be an int, got {type(value).__name__} ({value!r})")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions for one prompt (or every prompt of a ``generate`` call).

    ``temperature=0`` means greedy. ``top_k=-1`` / ``top_p=1`` disable truncation. ``stop_token_ids`` and
    ``stop`` (strings, needs a tokenizer) end a sample with finish reason ``"stop"``; the token that
    completes the stop is kept in the output. The model's end-of-sequence ids also stop a sample unless
    ``ignore_eos``. ``seed`` makes the samples reproducible and independent of batch composition.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in ("n", "top_k", "max_tokens") + (("seed",) if self.seed is not None else ()):
            _check_int(name, getattr(self, name))
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"SamplingParams.{name} must be a number, got {value!r}")
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1 (samples per prompt), got {self.n}")
        if not (self.temperature >= 0.0) or self.temperature == float("inf"):
            raise ValueError(f"SamplingParams.temperature must be finite and >= 0 (0 = greedy), "
                             f"got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"SamplingParams.temperature {self.temperature} is below {MIN_TEMPERATURE}: logits / "
                             f"temperature would overflow float32 (inf, then NaN log-probs); use 0 for greedy")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens must be >= 1, got {self.max_tokens}")
        for name in ("stop_token_ids", "stop"):  # None (vLLM's default for both) means none
            if getattr(self, name) is None:
                object.__setattr__(self, name, ())
        if isinstance(self.stop_token_ids, (str, int)):
            raise TypeError(f"SamplingParams.stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[...]", t)
            if t < 0:
                raise ValueError(f"SamplingParams.stop_token_ids must be non-negative, got {t}")
        object.__setattr__(self, "stop", (self.stop,) if isinstance(self.stop, str) else tuple(self.stop))
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {s!r}")
        if self.seed is not None and not (0 <= self.seed < 2 ** 64):
            raise ValueError(f"SamplingParams.seed must be in [0, 2**64), got {self.seed}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SamplingBatch:
    """Per-row sampling settings of one engine step, as device tensors (built once per step)."""

    temperature: torch.Tensor  # (B,) fp32; 0 = greedy
    top_k: torch.Tensor  # (B,) int64; -1 = off
    top_p: torch.Tensor  # (B,) fp32
    seed_lo: torch.Tensor  # (B,) int64, low 32 bits of the seed
    seed_hi: torch.Tensor  # (B,) int64, high 32 bits of the seed
    sample_index: torch.Tensor  # (B,) int64, which of the n samples of its prompt
    position: torch.Tensor  # (B,) int64, index of the token being sampled among the outputs
    is_seeded: torch.Tensor  # (B,) bool
    # host-side summaries, so the sampler skips work no row needs without a device sync
    any_truncation: bool = False
    any_seeded: bool = False
    any_unseeded_random: bool = False
    all_greedy: bool = False

    @staticmethod
    def build(params: list[SamplingParams], sample_index: list[int], position: list[int],
              device: torch.device | str) -> "SamplingBatch":
        """Pack the rows' parameters (``params[i]`` for row i) into tensors on ``device``."""
        seeds = [p.seed if p.seed is not None else 0 for p in params]
        host = torch.tensor([[float(p.temperature) for p in params], [float(p.top_p) for p in params],
                             [p.top_k for p in params], [s & _MASK32 for s in seeds],
                             [(s >> 32) & _MASK32 for s in seeds], sample_index, position,
                             [p.seed is not None for p in params]], dtype=torch.float64)  # exact for < 2**53
        rows = to_device(host, torch.device(device))  # one transfer per step, queued behind the step's forward
        as_long = rows[2:].to(torch.int64)
        return SamplingBatch(
            temperature=rows[0].to(torch.float32), top_p=rows[1].to(torch.float32), top_k=as_long[0],
            seed_lo=as_long[1], seed_hi=as_long[2], sample_index=as_long[3], position=as_long[4],
            is_seeded=as_long[5].bool(),
            any_truncation=any((p.top_k != -1 or p.top_p < 1.0) and not p.is_greedy for p in params),
            any_seeded=any(p.seed is not None and not p.is_greedy for p in params),
            any_unseeded_random=any(p.seed is None and not p.is_greedy for p in params),
            all_greedy=all(p.is_greedy for p in params))


# ----------------------------------------------------------------------------------------------------
# Counter-based noise: a 32-bit integer hash evaluated with int64 tensor ops (exact on CPU and CUDA).


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32 without int64 overflow (split x into 16-bit halves)."""
    lo = (x & 0xFFFF) * c
    hi = ((x >> 16) * c) & 0xFFFF
    return (lo + (hi << 16)) & _MASK32


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A well-mixing 32-bit integer hash (xorshift-multiply, "lowbias32" constants)."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


# The largest float32 below 1, the noise's upper bound: 24-bit noise k + 0.5 rounds to 2^24 in float32 (24 significant
# bits) at k = 2^24 - 1, which made u = 1 and the Gumbel noise -log(-log(u)) infinite, so that token won whatever its
# logit (once in 2^24 tokens: about one decode step in 110 at a 152K vocabulary). Clamped, that cell takes the Gumbel
# value of its lower edge (16.6), as every other cell does.
U_MAX = 1.0 - 2.0 ** -24


def seeded_uniform(seed_lo: torch.Tensor, seed_hi: torch.Tensor, sample_index: torch.Tensor,
                   position: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Uniform noise in (0, 1), (B, V) fp32, a pure function of (seed, sample index, position, token id): 24 bits
    of a hash as ``(k + 0.5) / 2^24``, at most :data:`U_MAX`."""
    key = _hash32(seed_lo ^ _hash32(seed_hi + 0x9E3779B9))
    key = _hash32(key ^ _hash32(sample_index + 0x85EBCA6B))
    key = _hash32(key ^ _hash32(position + 0xC2B2AE35))  # (B,)
    token = torch.arange(vocab_size, device=key.device, dtype=torch.int64)
    bits = _hash32(_hash32(key[:, None] ^ token[None, :]) + key[:, None])  # (B, V)
    return ((bits >> 8).to(torch.float32) + 0.5).mul_(1.0 / (1 << 24)).clamp_(max=U_MAX)


def _truncation_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Boolean (B, V): True where a token is removed by top-k, then top-p (on the top-k renormalised)."""
    vocab = scaled.shape[-1]
    sorted_vals, order = scaled.sort(dim=-1, descending=True)  # (B, V)
    ranks = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))  # (B,)
    removed_sorted = ranks[None, :] >= k[:, None]
    probs = sorted_vals.masked_fill(removed_sorted, float("-inf")).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly more likely tokens
    # rank 0 has mass_before 0 < top_p: always kept. top_p = 1 is off: the fp32 mass of a peaked
    # distribution can round to 1.0 before the last top-k token, which must not remove it
    removed_sorted |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)
    return torch.zeros_like(removed_sorted).scatter_(-1, order, removed_sorted)


def sample(logits: torch.Tensor, batch: SamplingBatch, impl: str | None = None, exact: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` (B, V) -> (tokens (B,) int64, logprobs (B,) fp32), on the logits'
    device with no host synchronisation (see the module doc). Where the seam picks the kernels
    (:func:`jetrl.quant.backend.choose_impl`: CUDA tensors under the CUDA backend; ``impl`` forces
    ``"reference"`` or ``"triton"``), a batch of seeded (and greedy) rows without truncation runs as one Triton
    kernel (:mod:`jetrl.quant.kernels.sampling_triton`: the same tokens, the log-probabilities up to fp32
    summation order) instead of the reference's many tensor ops over (B, V).

    ``exact`` (exact on-policy mode): the log-probabilities come from
    :func:`jetrl.models.logprobs.exact_logprobs_from_logits`, the trainer's function in exact mode (with the same
    ``impl``), on these very logits (the tokens are drawn as usual, from the same logits).
    """
    if exact:
        from jetrl.models.logprobs import exact_logprobs_from_logits

        tokens, _ = sample(logits, batch, impl)
        temperature = torch.where(batch.temperature == 0, torch.ones_like(batch.temperature), batch.temperature)
        return tokens, exact_logprobs_from_logits(logits, tokens, temperature, impl)[0]
    kernel_batch = (logits.dim() == 2 and not batch.all_greedy and not batch.any_truncation
                    and not batch.any_unseeded_random)
    if kernel_batch and choose_impl(logits, impl, op="seeded_sample") == "triton":
        from jetrl.quant.kernels.sampling_triton import seeded_sample

        return seeded_sample(logits, batch.temperature, batch.seed_lo, batch.seed_hi, batch.sample_index,
                             batch.position)
    logits = logits.float()
    greedy = batch.temperature == 0
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits / temperature[:, None]  # (B, V)
    logprobs_full = scaled.log_softmax(dim=-1)
    if batch.all_greedy:
        tokens = logits.argmax(dim=-1)
    else:
        scores = scaled
        if batch.any_truncation:
            scores = scores.masked_fill(_truncation_mask(scaled, batch.top_k, batch.top_p), float("-inf"))
        uniform = None  # not all_greedy: some row is seeded or unseeded
        if batch.any_seeded:
            uniform = seeded_uniform(batch.seed_lo, batch.seed_hi, batch.sample_index, batch.position, logits.shape[-1])
        if batch.any_unseeded_random:
            noise = torch.rand_like(scores).clamp_(min=2.0 ** -25, max=1.0 - 2.0 ** -24)  # float32 below 1
            uniform = noise if uniform is None else torch.where(batch.is_seeded[:, None], uniform, noise)
        gumbel = -torch.log(-torch.log(uniform))
        tokens = torch.where(greedy, logits.argmax(dim=-1), (scores + gumbel).argmax(dim=-1))
    return tokens, logprobs_full.gather(-1, tokens[:, None]).squeeze(-1)


__all__ = ["SamplingParams", "SamplingBatch", "sample", "seeded_uniform", "to_device"]
