"""The weight caches of the linears: an :class:`~jetrl.quant.linear.FP8Linear`'s own FP8 weight (and W^T), the
stacked FP8 weight of a group of them that read the same input (q/k/v, gate/up), and the stacked BF16 weight (and
bias) of a group of plain ``nn.Linear``s, which a decode-sized forward without grad multiplies in one GEMM
(:class:`_Bf16Stack`). Each is made at most once per weight version and written again into the same buffers when
the weight moves (stable addresses for the rollout's CUDA graphs). The caches live on the layers (a group's on its
first member).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from jetrl.quant.backend import get_backend
from jetrl.quant.formats import WEIGHT, Fp8Tensor


def _caches_transpose() -> bool:
    """Whether a forward should cache W^T's FP8 form with the weight: only with grad (DGrad reads it; rollout never
    pays its memory) and where the kernel tuning asks for it (``cache_weight_t``; else each backward transposes W's
    FP8 tiles, :meth:`~jetrl.quant.backend.Fp8Backend.transpose_weight`)."""
    from jetrl.quant.kernels.tuning import current  # a CPU-only module; kernels import lazily (tests/test_layering.py)

    return torch.is_grad_enabled() and current().cache_weight_t


def _write_into(old: Fp8Tensor | None, new: Fp8Tensor | None) -> Fp8Tensor | None:
    """Copy ``new`` into ``old``'s buffers when their layouts match (stable addresses), else ``new``."""
    if old is None or new is None or old.block != new.block:
        return new
    for a, b in ((old.data, new.data), (old.scale, new.scale)):
        if a.shape != b.shape or a.stride() != b.stride() or a.device != b.device or a.dtype != b.dtype:
            return new
    old.data.copy_(new.data)
    old.scale.copy_(new.scale)
    return old


def _stacked_weights(holder, modules: tuple[nn.Linear, ...], with_transpose: bool,
                     key: tuple | None = None) -> tuple[Fp8Tensor, Fp8Tensor | None]:
    """The FP8 weight of ``modules`` stacked along the output dim (one layer: its own weight), and W^T's with
    row-major data with ``with_transpose``, for their current weights: quantized at most once per weight version,
    in the same buffers across versions (stable addresses for the rollout's CUDA graphs). Tiles never straddle two
    members (widths of whole tiles), so each member's rows are bitwise that member's own quantization. Held by
    ``holder`` (the layer itself, or the group's :class:`_WeightCache`) in ``_qweight`` and ``_qweight_t``, current
    while ``_qweight_key`` is the members' weight keys (``key``, where the caller has them)."""
    if key is None:
        key = tuple(m.weight_key() for m in modules)
    q, q_t = holder._qweight, holder._qweight_t
    if holder._qweight_key == key and q is not None and (q_t is not None or not with_transpose):
        return q, q_t  # current: every call after the first per weight version
    stale_q = stale_t = None
    if holder._qweight_key != key:
        stale_q, stale_t = q, q_t
        holder._qweight = holder._qweight_t = None
        holder._qweight_key = key
    first = modules[0]
    backend = get_backend(first.weight.device)
    with torch.no_grad():
        if holder._qweight is None:
            w = torch.cat([m.weight_values() for m in modules]) if len(modules) > 1 else first.weight_values()
            if with_transpose:  # W and W^T from one read of the weight
                q, q_t = backend.quantize_weight_pair(w, first.pow2_scale)
                holder._qweight_t = _write_into(stale_t, q_t)
            else:
                q = backend.quantize(w, WEIGHT, first.pow2_scale)
            holder._qweight = _write_into(stale_q, q)
        elif with_transpose:  # W^T from W's tiles, without reading the weight again
            holder._qweight_t = backend.transpose_weight(holder._qweight)
    return holder._qweight, holder._qweight_t


class _WeightCache:
    """The FP8 weights of a group of linears sharing an input, stacked along the output dim (held as a layer holds
    its own, :func:`_stacked_weights`): W (sum N, K) and, once a grad-enabled forward asked for it, W^T; with the
    member layers (for re-quantization)."""

    def __init__(self, modules: tuple[nn.Linear, ...]) -> None:
        self.modules = modules
        self._qweight_key: tuple | None = None
        self._qweight: Fp8Tensor | None = None
        self._qweight_t: Fp8Tensor | None = None
        # whether the members' layouts stack (:func:`_layouts_stack`), for the weight keys and biases it was decided on
        self.layout: tuple | None = None
        self.stacks = False


def _layouts_stack(modules: tuple[nn.Linear, ...]) -> bool:
    """The layout half of :func:`~jetrl.quant.linear.groupable` (which says what must match)."""
    first = modules[0]
    w0 = first.weight
    return all(m.in_features == first.in_features and m.out_features % 128 == 0 and m.weight.dtype == w0.dtype
               and m.weight.device == w0.device and (m.bias is None) == (first.bias is None) for m in modules)


def _group_cache(modules: tuple[nn.Linear, ...]) -> _WeightCache:
    """The group's cache, kept by its first member under the members' ids."""
    ids = tuple(id(m) for m in modules)
    cache = modules[0]._group_caches.get(ids)
    if cache is None:
        cache = modules[0]._group_caches[ids] = _WeightCache(modules)
    return cache


class _Bf16Stack:
    """The weights (and biases) of plain linears that read the same input, stacked along the output dim: one GEMM
    for a decode step's q/k/v or gate/up instead of one per layer, at the memory of a second copy of those weights.
    Current while ``key`` is the members' (:func:`_bf16_key`)."""

    def __init__(self, modules: tuple[nn.Linear, ...]) -> None:
        self.modules = modules
        self.key: tuple | None = None
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None


_BF16_STACKS = "_bf16_stacks"  # the attribute of a group's first member that holds its stacks, by the members' ids


def _bf16_key(modules: tuple[nn.Linear, ...]) -> tuple:
    """What a stack's values depend on: each member's weight and bias storage and version."""
    return tuple((t.data_ptr(), t._version, tuple(t.shape), t.dtype, t.device)
                 for m in modules for t in (m.weight, m.bias) if t is not None)


# A group is stacked where one of its members' weights is at most this many bytes: a decode GEMM that reads so little
# takes about its fixed launch-to-finish latency, which one GEMM for the group saves (q/k/v: k and v are narrow). A
# group of wide members (a 1.5B or 8B model's gate/up) reads at about copy speed either way, so a second copy of its
# weights would buy little, or lose (docs/benchmark-history.md, "Stacked BF16 q/k/v").
BF16_STACK_MAX_MEMBER_BYTES = 16 << 20


def _bf16_stackable(modules: tuple[nn.Module, ...], x: torch.Tensor) -> bool:
    """Whether plain linears can multiply ``x`` as one stacked weight: each exactly ``nn.Linear``, one input width,
    the input's dtype and device, biases on all or none, and a member narrow enough for one GEMM to pay
    (:data:`BF16_STACK_MAX_MEMBER_BYTES`)."""
    first = modules[0]
    return (all(type(m) is nn.Linear and m.in_features == first.in_features and m.weight.dtype == x.dtype
                and m.weight.device == x.device and (m.bias is None) == (first.bias is None) for m in modules)
            and min(m.weight.nbytes for m in modules) <= BF16_STACK_MAX_MEMBER_BYTES)


def _cat_into(old: torch.Tensor | None, parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``, written into ``old`` where its shape, dtype and device fit (stable address)."""
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    if old is not None and old.shape == shape and old.dtype == parts[0].dtype and old.device == parts[0].device:
        return torch.cat(parts, out=old)
    return torch.cat(parts)


def _refresh_bf16(stack: _Bf16Stack) -> _Bf16Stack:
    key = _bf16_key(stack.modules)
    if stack.key != key:
        with torch.no_grad():
            stack.weight = _cat_into(stack.weight, [m.weight for m in stack.modules])
            if stack.modules[0].bias is not None:
                stack.bias = _cat_into(stack.bias, [m.bias for m in stack.modules])
        stack.key = key
    return stack


def bf16_stacked(modules: tuple[nn.Linear, ...]) -> _Bf16Stack:
    """The current stacked BF16 weight of ``modules`` (:func:`_bf16_stackable`), made on first use, held by the
    first member."""
    stacks = vars(modules[0]).setdefault(_BF16_STACKS, {})
    ids = tuple(id(m) for m in modules)
    if ids not in stacks:
        stacks[ids] = _Bf16Stack(modules)
    return _refresh_bf16(stacks[ids])


def bf16_stacks(module: nn.Module) -> list[_Bf16Stack]:
    """The stacked BF16 weights ``module`` holds as a group's first member, each brought to the current weight
    version (written again into its buffers where a member moved): what a captured decode graph reads."""
    return [_refresh_bf16(stack) for stack in vars(module).get(_BF16_STACKS, {}).values()]


def invalidate_bf16_stacks(module: nn.Module) -> None:
    """Mark ``module``'s stacks stale (its members' weights changed behind the version counter, e.g. through
    ``.data`` or a collective): the next use copies them again, into the same buffers."""
    for stack in vars(module).get(_BF16_STACKS, {}).values():
        stack.key = None


def _member_weights(qweight: Fp8Tensor, modules: tuple[nn.Linear, ...]) -> list[Fp8Tensor]:
    """Each member's rows of the stacked FP8 weight (views: whole tiles, so data and scales slice cleanly)."""
    out, row = [], 0
    for m in modules:
        n = m.out_features
        out.append(Fp8Tensor(qweight.data[row:row + n], qweight.scale[row // 128:(row + n) // 128], WEIGHT))
        row += n
    return out
