"""The quantized-weight caches of :class:`~jetrl.quant.linear.FP8Linear`: a layer's own FP8 weight (and W^T), and
the stacked FP8 weight of a group of layers that read the same input (q/k/v, gate/up). Each is made at most once
per weight version and re-quantized into the same buffers when the weight moves (stable addresses for the
rollout's CUDA graphs). The layers passed here are ``FP8Linear``s; the caches live on them (a group's on its
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


def _member_weights(qweight: Fp8Tensor, modules: tuple[nn.Linear, ...]) -> list[Fp8Tensor]:
    """Each member's rows of the stacked FP8 weight (views: whole tiles, so data and scales slice cleanly)."""
    out, row = [], 0
    for m in modules:
        n = m.out_features
        out.append(Fp8Tensor(qweight.data[row:row + n], qweight.scale[row // 128:(row + n) // 128], WEIGHT))
        row += n
    return out
