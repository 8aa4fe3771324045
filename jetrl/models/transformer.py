"""One decoder for Llama 3.x, Qwen2/2.5 and Qwen3, with HuggingFace parameter names.

Module tree (names are the HF state-dict keys, so loading is a loop over the checkpoint)::

    DecoderLM
      model.embed_tokens                      nn.Embedding            (stays BF16)
      model.layers[i].input_layernorm         RMSNorm                 (fp32 math)
      model.layers[i].self_attn.{q,k,v,o}_proj nn.Linear              (-> FP8Linear under a recipe)
      model.layers[i].self_attn.{q,k}_norm    RMSNorm over head_dim   (Qwen3 only)
      model.layers[i].post_attention_layernorm RMSNorm
      model.layers[i].mlp.{gate,up,down}_proj nn.Linear               (-> FP8Linear under a recipe)
      model.norm                              RMSNorm
      lm_head                                 nn.Linear, maybe tied   (stays BF16)

Every block linear is a plain ``nn.Linear``: :func:`jetrl.quant.apply_recipe` swaps them for
``FP8Linear`` in place, so the FP8 rollout and the FP8 training run this very module graph.

All entry points flatten tokens to rows (N, hidden) and differ only in how attention reads K/V: ``model(input_ids)``
(a plain (B, T) causal batch), :meth:`DecoderLM.forward_packed` (packed sequences of different lengths, returning
hidden states for :func:`jetrl.models.token_logprobs`) and :meth:`DecoderLM.forward_paged` (one rollout step over a
paged KV cache, :mod:`jetrl.models.attention`).
"""

from __future__ import annotations

import contextvars
import functools
import math
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from jetrl.models.attention import (
    PagedAttentionMetadata, PagedKVCache, _seq_lengths, exact_attention, exact_varlen_attention, fake_quantize_kv,
    packed_as_paged, paged_attention, plan_exact_attention, varlen_attention, varlen_attention_on_device, write_kv,
)
from jetrl.models.config import DecoderConfig
from jetrl.models.rope import apply_rope, apply_rope_qk
from jetrl.quant import call_linear, fp8_input_scaling, grouped_linear, linears_shared_input
from jetrl.quant.norm import NormOutput, rms_norm
from jetrl.quant.swiglu import swiglu, swiglu_packed

# attend(layer_idx, q (N, Hq, D), k (N, Hkv, D), v (N, Hkv, D), softmax_scale) -> (N, Hq, D)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, normalised in fp32 and cast back before the weight (as HF does).

    Runs :func:`jetrl.quant.norm.rms_norm`: one fused kernel on the GPU, the PyTorch formulas elsewhere.
    """

    def __init__(self, dim: int, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps).out

    def fused(self, x: torch.Tensor, residual: torch.Tensor | None, fp8_scaling: bool | None) -> NormOutput:
        """Norm of ``x + residual`` (the new residual stream comes back too), plus the output's 1x128 FP8
        when ``fp8_scaling`` is not None (the next linears' input, see :func:`jetrl.quant.fp8_input_scaling`)."""
        return rms_norm(x, self.weight, self.eps, residual, quantize=fp8_scaling is not None,
                        pow2_scale=bool(fp8_scaling))


def rope_inv_freq(config: DecoderConfig) -> torch.Tensor:
    """RoPE inverse frequencies (head_dim / 2,) in fp32 on CPU, with ``linear`` or ``llama3`` scaling."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths slowed by `factor`, short ones kept, a smooth blend in between
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """cos, sin (N, head_dim) for integer positions (N,), computed in fp32 then cast to ``dtype``."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (N, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (N, D)
    return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    """GQA self-attention; how K/V are stored and read is delegated to ``attend``."""

    def __init__(self, config: DecoderConfig, layer_idx: int, device=None, dtype=None) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.softmax_scale = c.head_dim ** -0.5
        kw = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=c.qkv_bias, **kw)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias, **kw)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=c.qkv_bias, **kw)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=c.o_proj_bias, **kw)
        if c.qk_norm:
            self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, **kw)
        else:
            self.q_norm = self.k_norm = None

    def input_projections(self) -> tuple[nn.Module, ...]:
        return self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                x_fp8=None, exact: bool = False) -> torch.Tensor:
        n = x.shape[0]  # x: (N, hidden); x_fp8: its 1x128 FP8 made by the norm, shared by q, k and v
        # one launch when decoding (exact mode: each layer's batch-invariant GEMM)
        q, k, v = linears_shared_input(self.input_projections(), x, x_fp8, exact=exact)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope_qk(q, k, cos, sin)
        out = attend(self.layer_idx, q, k, v, self.softmax_scale)  # (N, Hq, D)
        return call_linear(self.o_proj, out.reshape(n, self.num_heads * self.head_dim), exact=exact)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: DecoderConfig, device=None, dtype=None) -> None:
        super().__init__()
        c, kw = config, dict(device=device, dtype=dtype)
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, **kw)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=c.mlp_bias, **kw)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=c.mlp_bias, **kw)

    def input_projections(self) -> tuple[nn.Module, ...]:
        return self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, x_fp8=None, exact: bool = False) -> torch.Tensor:
        # silu(gate) * up in one kernel, which also quantizes it for an FP8 down projection; gate and up side by side
        # where their FP8 GEMMs run as one (so the backward's d(gate, up) is one buffer, no concatenation). An FP8
        # down projection reads only the FP8 product, so the BF16 one is not written (fp8_only; exact mode keeps it)
        scaling = fp8_input_scaling(self.down_proj)
        kw = dict(quantize=scaling is not None, pow2_scale=bool(scaling), fp8_only=scaling is not None and not exact,
                  exact=exact)
        gate_up = grouped_linear(self.input_projections(), x, x_fp8, exact=exact)
        if gate_up is not None:
            act, act_fp8 = swiglu_packed(gate_up, **kw)
        else:
            gate, up = (call_linear(m, x, x_fp8, exact=exact) for m in self.input_projections())
            act, act_fp8 = swiglu(gate, up, **kw)
        return call_linear(self.down_proj, act, act_fp8, exact=exact)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm(x)); out = h + mlp(norm(h))``.

    The residual additions run inside the norms (one fused kernel computes ``h = x + r`` and ``norm(h)``,
    and the FP8 input of the next linears when they run FP8), so a block takes and returns the pair
    ``(x, residual)`` whose sum is the residual stream: ``out = x_out + residual_out``. The values are those
    of the unfused formulas (the same BF16 additions, in the same order).
    """

    def __init__(self, config: DecoderConfig, layer_idx: int, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.self_attn = Attention(config, layer_idx, **kw)
        self.mlp = MLP(config, **kw)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                attend: Attend, exact: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, residual)`` -> ``(mlp_out, h)`` with the block's input stream ``x + residual`` (``residual``
        None: the stream is ``x``). ``exact``: batch-invariant linears (exact mode)."""
        normed = self.input_layernorm.fused(x, residual, fp8_input_scaling(*self.self_attn.input_projections()))
        stream = normed.residual if normed.residual is not None else x
        attn = self.self_attn(normed.out, cos, sin, attend, normed.out_fp8, exact)
        normed = self.post_attention_layernorm.fused(attn, stream, fp8_input_scaling(*self.mlp.input_projections()))
        return self.mlp(normed.out, normed.out_fp8, exact), normed.residual


class DecoderModel(nn.Module):
    """Embedding, the blocks and the final norm (HF's ``model.*``)."""

    def __init__(self, config: DecoderConfig, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(config, i, **kw) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.inv_freq = rope_inv_freq(config)  # plain attribute: never cast by .to(dtype), moved lazily
        self.checkpoint_blocks = 0  # the first N blocks are recomputed in backward (set_activation_checkpointing)

    def _inv_freq_on(self, device: torch.device) -> torch.Tensor:
        if self.inv_freq.device != device:
            self.inv_freq = self.inv_freq.to(device)
        return self.inv_freq

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
                exact: bool = False) -> torch.Tensor:
        """Rows (N,) of token ids at ``positions`` -> final hidden states (N, hidden). ``exact``: the blocks'
        linears batch-invariant (exact mode; ``attend`` then must be exact mode's attention too)."""
        h = self.embed_tokens(input_ids)  # (N, hidden)
        cos, sin = rope_cos_sin(self._inv_freq_on(h.device), positions, h.dtype)
        recomputed = self.checkpoint_blocks if torch.is_grad_enabled() else 0
        residual = None
        for i, layer in enumerate(self.layers):
            if i < recomputed:
                # the blocks draw no random numbers: no RNG state to stash (which a CUDA graph capture forbids). The
                # recomputation runs in a copy of this forward's context variables (the kernel tuning in force, a
                # forced fused implementation): autograd recomputes a CUDA block on its own device thread, whose
                # context is empty, and would otherwise take the default kernels, not the ones this forward took
                h, residual = checkpoint(functools.partial(contextvars.copy_context().run, layer), h, residual, cos,
                                         sin, attend, exact, use_reentrant=False, preserve_rng_state=False)
            else:
                h, residual = layer(h, residual, cos, sin, attend, exact)
        return self.norm.fused(h, residual, None).out


class DecoderLM(nn.Module):
    """The causal LM: :class:`DecoderModel` plus the LM head (tied to the embedding if the config says so)."""

    def __init__(self, config: DecoderConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, device=device, dtype=dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=dtype)
        # the checkpoint folder whose tokenizer files go with these weights (set by load_model; save_model copies
        # them along)
        self.source_path: str | None = None
        self.tie_weights()

    # ---------------------------------------------------------------- setup
    def tie_weights(self) -> None:
        """Share the LM head with the embedding when ``tie_word_embeddings`` (after any re-materialisation)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def set_activation_checkpointing(self, enabled: bool = True, blocks: int | None = None) -> "DecoderLM":
        """Recompute blocks in backward instead of keeping their activations (per-block checkpointing): every
        block, or with ``blocks`` the first ``blocks`` of them (the others keep their activations: more memory,
        no recomputation; the gradients are the same either way)."""
        if blocks is not None and (isinstance(blocks, bool) or not isinstance(blocks, int)
                                   or not 0 <= blocks <= len(self.model.layers)):
            raise ValueError(f"checkpointed blocks must be an int from 0 to the model's {len(self.model.layers)} "
                             f"blocks (or None: all), got {blocks!r}")
        self.model.checkpoint_blocks = (len(self.model.layers) if blocks is None else blocks) if enabled else 0
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    # ---------------------------------------------------------------- entry points
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal batch: (B, T) token ids -> (B, T, vocab) logits in the LM head's dtype."""
        if input_ids.dim() != 2:
            raise ValueError(f"model(input_ids) expects a (B, T) tensor, got shape {tuple(input_ids.shape)}; use "
                             f"forward_packed for packed rows")
        _check_ids(input_ids, self.config.vocab_size)
        batch, seq_len = input_ids.shape
        if batch * seq_len == 0:
            return self.lm_head.weight.new_zeros(batch, seq_len, self.config.vocab_size)
        positions = torch.arange(seq_len, device=input_ids.device).repeat(batch)
        cu = list(range(0, batch * seq_len + 1, seq_len))
        hidden = self.model(input_ids.reshape(-1), positions, _packed_attend(cu))
        return self.lm_head(hidden).view(batch, seq_len, -1)

    def forward_packed(self, input_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                       max_seqlen: int | None = None, *, exact: bool = False, kv_fp8: bool = False,
                       check_ids: bool = True) -> torch.Tensor:
        """Packed sequences: ids and positions (N,), ``cu_seqlens`` (S+1,) -> final hidden states (N, hidden).

        Attention is block-diagonal causal; positions are explicit, so a packed row can continue a prompt at any
        offset. ``cu_seqlens`` is read on the host once per call (a host list costs no sync); ``max_seqlen``, when
        given, is checked against it. ``exact``: exact on-policy mode (:mod:`jetrl.quant.exact`), each row's hidden
        state bitwise what :meth:`forward_paged` with ``exact`` computes. ``kv_fp8``: attention reads K (after RoPE)
        and V as an FP8 KV cache holds them (:func:`~jetrl.models.attention.fake_quantize_kv`, the gradient straight
        through; with ``exact``, bitwise the hidden states over an FP8 cache). ``check_ids``: check on the device that
        the ids are inside the vocabulary (a host sync); a caller that checked them on the host passes False.
        """
        _check_packed("forward_packed", input_ids, positions)
        if check_ids:
            _check_ids(input_ids, self.config.vocab_size)
        cu = [int(c) for c in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
        longest = max(_seq_lengths(cu, input_ids.shape[0]))
        if max_seqlen is not None and longest > max_seqlen:
            raise ValueError(f"a packed sequence has {longest} tokens, more than max_seqlen={max_seqlen}")
        return self.model(input_ids, positions, _kv_fp8_attend(_packed_attend(cu, exact), kv_fp8), exact)

    def forward_packed_on_device(self, input_ids: torch.Tensor, positions: torch.Tensor, cu_seqlens: torch.Tensor,
                                 max_seqlen: int, *, kv_fp8: bool = False) -> torch.Tensor:
        """:meth:`forward_packed` (fast mode) reading nothing on the host, so that a CUDA graph can capture it:
        ``cu_seqlens`` (S+1,) int32 on the device (zero-length sequences allowed), ``max_seqlen`` an upper bound of
        the lengths; the flash path only (:func:`~jetrl.models.attention.varlen_attention_on_device`), ids unchecked."""
        _check_packed("forward_packed_on_device", input_ids, positions)

        def attend(layer_idx: int, q, k, v, softmax_scale: float) -> torch.Tensor:
            return varlen_attention_on_device(q, k, v, cu_seqlens, max_seqlen, softmax_scale)
        return self.model(input_ids, positions, _kv_fp8_attend(attend, kv_fp8))

    def forward_paged(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: PagedAttentionMetadata,
                      kv_cache: PagedKVCache, logits_indices: torch.Tensor | None = None, *,
                      exact: bool = False) -> torch.Tensor:
        """One rollout step over a paged KV cache -> logits (L, vocab) of the rows in ``logits_indices``, in the LM
        head's dtype (the sampler reads them as their fp32 values, without a (L, vocab) fp32 copy per step).

        Writes K/V of the N new tokens at ``meta.slot_mapping`` (quantized in an FP8 cache), then attends through
        :func:`~jetrl.models.attention.paged_attention` (``exact``: :func:`~jetrl.models.attention.exact_attention`,
        with exact mode's linears and LM head). No host syncs, no data-dependent shapes: a CUDA graph can capture it.
        """
        if kv_cache.num_layers != self.config.num_hidden_layers:
            raise ValueError(f"kv_cache has {kv_cache.num_layers} layers, the model {self.config.num_hidden_layers}")
        if exact:  # the attention kernel's program numbering, once for all layers
            meta = plan_exact_attention(meta, input_ids, self.config.num_attention_heads,
                                        self.config.num_key_value_heads)

        def attend(layer_idx: int, q, k, v, softmax_scale: float) -> torch.Tensor:
            k_layer, v_layer, k_scale, v_scale = kv_cache.layer(layer_idx)
            write_kv(k_layer, v_layer, k, v, meta.slot_mapping, k_scale, v_scale)
            if exact:
                return exact_attention(q, k_layer, v_layer, meta, softmax_scale, k_scale=k_scale, v_scale=v_scale)
            return paged_attention(q, k_layer, v_layer, meta, softmax_scale, k_scale=k_scale, v_scale=v_scale)

        hidden = self.model(input_ids, positions, attend, exact)
        if logits_indices is not None:
            hidden = hidden[logits_indices]
        return call_linear(self.lm_head, hidden, exact=exact)

    def compute_logits(self, hidden: torch.Tensor, *, exact: bool = False) -> torch.Tensor:
        """LM head on hidden rows (..., hidden) -> fp32 logits (..., vocab); ``exact``: batch-invariant."""
        return call_linear(self.lm_head, hidden, exact=exact).float()


def _check_packed(what: str, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise ValueError(f"{what} expects input_ids and positions of shape (N,), got {tuple(input_ids.shape)} and "
                         f"{tuple(positions.shape)}")


def _kv_fp8_attend(attend: Attend, kv_fp8: bool) -> Attend:
    """``attend``, with ``kv_fp8`` over K and V as an FP8 KV cache holds them (straight-through gradient)."""
    if not kv_fp8:
        return attend
    return lambda layer_idx, q, k, v, scale: attend(layer_idx, q, fake_quantize_kv(k), fake_quantize_kv(v), scale)


def _packed_attend(cu_seqlens: list[int], exact: bool = False) -> Attend:
    metas: dict = {}  # exact mode: the packing as paged metadata, made by the first layer, read by all (and
    # by the recomputation of checkpointed blocks): its host-to-device copies once per forward, not per layer
    offsets: dict = {}  # the same for the flash path's device offsets

    def attend(layer_idx: int, q, k, v, softmax_scale: float) -> torch.Tensor:
        if exact:
            if q.device not in metas and q.shape[0]:
                metas[q.device] = plan_exact_attention(packed_as_paged(cu_seqlens, q.device), q, q.shape[1], k.shape[1])
            return exact_varlen_attention(q, k, v, cu_seqlens, softmax_scale, metas.get(q.device))
        if q.is_cuda and q.device not in offsets:  # pinned and asynchronous: a pageable copy would sync the stream
            offsets[q.device] = torch.tensor(cu_seqlens, dtype=torch.int32).pin_memory().to(q.device, non_blocking=True)
        return varlen_attention(q, k, v, cu_seqlens, softmax_scale, offsets.get(q.device))
    return attend


def _check_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Integer ids inside ``[0, vocab_size)``: a clear error instead of an embedding IndexError (CPU) or a
    device-side assert (CUDA). Costs one host sync; the paged rollout path does not call it."""
    if input_ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"input_ids must be an integer (int64/int32) tensor, got {input_ids.dtype}")
    if input_ids.numel():
        low, high = (int(v) for v in torch.aminmax(input_ids))
        if low < 0 or high >= vocab_size:
            raise ValueError(f"input_ids hold token ids in [{low}, {high}], outside the vocabulary [0, {vocab_size})")


def init_weights(model: DecoderLM, std: float = 0.02, generator: torch.Generator | None = None) -> None:
    """Random init in place (normal(0, std) for linears and the embedding, ones for norms, zero biases)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                _normal_(module.weight, std, generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                _normal_(module.weight, std, generator)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)


def _normal_(t: torch.Tensor, std: float, generator: torch.Generator | None) -> None:
    if generator is None or generator.device == t.device:
        t.normal_(0.0, std, generator=generator)
    else:  # a generator on another device: draw there, then copy
        t.copy_(torch.empty(t.shape, dtype=torch.float32, device=generator.device).normal_(0.0, std,
                                                                                          generator=generator))


def build_model(config: DecoderConfig | dict, dtype: torch.dtype = torch.bfloat16,
                device: torch.device | str | None = None, recipe: str | object = "bf16",
                seed: int | None = 0, init: bool = True) -> DecoderLM:
    """A randomly initialised model from a :class:`DecoderConfig` or a HF config dict.

    Built on the meta device, then allocated once on ``device`` (no second copy) and initialised
    (``init=False`` leaves the memory uninitialised, for a loader that fills every tensor; ``seed``
    seeds a generator on ``device``, so the same seed gives the same weights on the same kind of
    device). ``recipe`` is applied last (``"bf16"``, ``"fp8-rollout"``, ``"jet"`` or a ``PrecisionRecipe``).
    """
    from jetrl.quant import apply_recipe

    if isinstance(config, dict):
        config = DecoderConfig.from_hf(config)
    if not isinstance(config, DecoderConfig):
        raise TypeError(f"build_model needs a DecoderConfig or a HF config dict, got {type(config).__name__}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    with torch.device("meta"):
        model = DecoderLM(config, dtype=dtype)
    model.to_empty(device=device)
    model.tie_weights()
    if init:
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        init_weights(model, generator=generator)
    apply_recipe(model, recipe)
    return model


__all__ = ["DecoderLM", "DecoderModel", "DecoderLayer", "Attention", "MLP", "RMSNorm", "build_model",
           "init_weights", "rope_inv_freq", "rope_cos_sin", "apply_rope"]
