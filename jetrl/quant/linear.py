"""``FP8Linear``: a drop-in ``nn.Linear`` whose three GEMMs run in blockwise FP8 (the op, taught in
:mod:`jetrl.quant.linear_op`), and the entry points the models call it through: :func:`call_linear` (one layer,
with a fused producer's FP8 input, :func:`fp8_input_scaling`), :func:`grouped_linear` and
:func:`linears_shared_input` (linears that read the same input, as one stacked FP8 linear, or one BF16 GEMM when
decoding).

**Unified precision flow.** Rollout and training call this same module on the same weight and read the same
quantized weight (cached per weight version, :mod:`jetrl.quant.weight_cache`; no calibration), so the tokens the
policy learns from were produced by exactly the FP8 policy that is being trained. Which precision each side runs is
set by the recipe (:mod:`jetrl.quant.recipe`): the module holds ``fp8_rollout`` and ``fp8_train`` and reads the
side from :func:`jetrl.quant.side.current_side`.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from jetrl.quant.backend import GemmWeight, get_backend, selected_backend_name
from jetrl.quant.exact import exact_linear
from jetrl.quant.formats import ACT, Fp8Tensor
from jetrl.quant.linear_op import fp8_linear_group
from jetrl.quant.side import current_side
from jetrl.quant.weight_cache import (_bf16_stackable, _caches_transpose, _group_cache, _layouts_stack,
                                      _member_weights, _stacked_weights, _WeightCache, bf16_stacked)


class FP8Linear(nn.Linear):
    """``nn.Linear`` with FP8 Fprop/DGrad/WGrad; same parameters, same state-dict keys.

    ``fp8_train`` / ``fp8_rollout`` choose, per side, FP8 or the plain ``F.linear`` on the weight.
    ``check_finite`` raises on NaN/Inf inputs of an FP8 forward (a debugging aid: it costs a device sync per call).
    After :meth:`release_weight` (``jet``'s trainer on one process) ``weight`` is a NaN placeholder whose values live
    in the optimizer's fp32 master: read them with :meth:`weight_values` or the state dict.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 fp8_train: bool = True, fp8_rollout: bool = True, pow2_scale: bool = False,
                 check_finite: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fp8_train = fp8_train
        self.fp8_rollout = fp8_rollout
        self.pow2_scale = pow2_scale
        self.check_finite = check_finite
        # the layer's own FP8 weight and W^T, and the weight keys they are current for (:mod:`~.weight_cache`)
        self._qweight_key: tuple | None = None
        self._qweight: Fp8Tensor | None = None
        self._qweight_t: Fp8Tensor | None = None
        self._cache_epoch = 0  # moved by invalidate_weight_cache: every cache keyed on this layer goes stale
        # FP8 weights of groups this layer leads (linears sharing its input: q/k/v, gate/up), by member ids
        self._group_caches: dict[tuple[int, ...], _WeightCache] = {}
        self._master: torch.Tensor | None = None  # set by release_weight: the weight's values live there

    def release_weight(self, master: torch.Tensor) -> None:
        """Hold the weight's values only in ``master`` (its fp32 master copy, which an optimizer updates in place):
        the BF16 weight's storage is dropped (2 bytes per parameter; the parameter becomes a NaN placeholder of
        its shape, which autograd still routes the gradient to), and the FP8 weights are quantized from
        ``master`` rounded to the weight's dtype: the same bytes as from the BF16 weight the optimizer would have
        written. Only for a layer that runs FP8 on both sides (the weight's values are read nowhere else) and
        an unsharded weight. :meth:`weight_values` gives the values; the state dict holds them under ``weight``
        as before, and loading one writes them into ``master``."""
        w = self.weight
        if not (self.fp8_train and self.fp8_rollout):
            raise ValueError(f"{self!r}: only a layer that runs FP8 on both sides can drop its BF16 weight")
        if type(w.data) is not torch.Tensor or master.dtype != torch.float32 or master.shape != w.shape \
                or master.device != w.device:
            raise ValueError(f"{self!r}: the master must be an fp32 tensor of the (unsharded) weight's shape "
                             f"{tuple(w.shape)} on {w.device}, got {master.dtype} {tuple(master.shape)} on "
                             f"{master.device}")
        if self._master is None:
            self._master = master
            w.data = torch.full((), float("nan"), dtype=w.dtype, device=w.device).expand(w.shape)
            self.invalidate_weight_cache()

    def restore_weight(self) -> None:
        """Undo :meth:`release_weight`: the weight holds its values again (the master rounded to its dtype), for an
        optimizer built after it (which starts its own master from them, as from any BF16 weight)."""
        if self._master is not None:
            self.weight.data = self.weight_values()
            self._master = None
            self.invalidate_weight_cache()

    @property
    def weight_released(self) -> bool:
        """Whether :meth:`release_weight` dropped the BF16 weight (its values are the master's, rounded)."""
        return self._master is not None

    def weight_values(self) -> torch.Tensor:
        """The weight's values (detached): the parameter's, or after :meth:`release_weight` the master's rounded
        to the weight's dtype (a fresh tensor)."""
        if self._master is None:
            return self.weight.detach()
        return self._master.detach().to(self.weight.dtype)

    @torch.no_grad()
    def copy_weight_(self, value: torch.Tensor) -> None:
        """Write ``value`` into the weight (a load). After :meth:`release_weight` into the master, which keeps its
        fp32 bits when ``value`` is the weight it already rounds to (a resume loads the master itself, with the
        optimizer state); any other value replaces it."""
        if self._master is None:
            self.weight.copy_(value)
            return
        value = value.to(device=self._master.device)
        if not torch.equal(value.to(self.weight.dtype), self.weight_values()):
            self._master.copy_(value)
            self.invalidate_weight_cache()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._master is not None:  # the values, not the placeholder
            destination[prefix + "weight"] = self.weight_values()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        key = prefix + "weight"
        if self._master is None or key not in state_dict:
            return super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                                 unexpected_keys, error_msgs)
        value = state_dict[key]
        if tuple(value.shape) != tuple(self.weight.shape):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape {tuple(value.shape)}, the "
                              f"shape in current model is {tuple(self.weight.shape)}.")
            return None
        self.copy_weight_(value)
        rest = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(rest, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs)
        if key in missing_keys:
            missing_keys.remove(key)
        return None

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> "FP8Linear":
        """Wrap an existing ``nn.Linear``, sharing its parameters (optimizers and tied weights stay valid)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"FP8Linear.from_linear needs an nn.Linear, got {type(linear).__name__}")
        return _sharing(cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                            **options), linear)

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` sharing this layer's parameters (not after :meth:`release_weight`: its weight's
        values are in the optimizer's master, which a plain layer would not read)."""
        if self._master is not None:
            raise ValueError(f"{self!r} dropped its BF16 weight (its values are its optimizer's fp32 master): a plain "
                             f"nn.Linear cannot share it; change the recipe before training starts")
        return _sharing(nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta"), self)

    def uses_fp8(self) -> bool:
        """Whether the current side runs this layer in FP8."""
        return self.fp8_rollout if current_side() == "rollout" else self.fp8_train

    def invalidate_weight_cache(self) -> None:
        """Mark the quantized weight stale (call after changing the weight behind autograd's back), also in the
        groups it belongs to (:func:`grouped_linear`).

        The next use re-quantizes into the same buffers, so their addresses stay fixed and CUDA graphs
        captured by the rollout engine stay valid across optimizer steps.
        """
        self._cache_epoch += 1  # part of weight_key: every cache of this layer's weight goes stale

    def weight_key(self) -> tuple:
        """What the quantized weight depends on: the weight's storage and version (the master's after
        :meth:`release_weight`), the scaling, the backend."""
        w = self.weight
        src = self._master if self._master is not None else w  # where the values live
        return (src._version, src.data_ptr(), w.device, w.dtype, tuple(w.shape), self.pow2_scale,
                selected_backend_name(), self._cache_epoch)

    def _holders(self) -> list:
        """``(holder, members)`` of each FP8 weight this layer may hold: its own, then each group's it leads."""
        return [(self, (self,))] + [(cache, cache.modules) for cache in self._group_caches.values()]

    def refresh_cached_weights(self) -> None:
        """Re-quantize each FP8 weight this layer holds (its own, its groups'), and the W^T held beside it, into the
        same buffers: the update's CUDA graphs, keyed on those storages, survive the refresh."""
        for holder, members in self._holders():
            if holder._qweight is not None:
                _stacked_weights(holder, members, with_transpose=holder._qweight_t is not None)

    def forward_gemm_weights(self) -> list[GemmWeight]:
        """The FP8 weights this layer's forwards have multiplied so far: its own W where it ran alone, and the
        stacked W of each group it leads (:func:`grouped_linear`) with whether that group has biases."""
        return [GemmWeight(*holder._qweight.shape, biased_group=holder is not self and members[0].bias is not None)
                for holder, members in self._holders() if holder._qweight is not None]

    def cached_fp8_tensors(self) -> list[Fp8Tensor]:
        """The FP8 weights this layer holds: its own W (and W^T), and those of the groups it leads."""
        return [q for holder, _ in self._holders() for q in (holder._qweight, holder._qweight_t) if q is not None]

    def current_fp8_tensors(self, transposes: bool = True) -> list[Fp8Tensor]:
        """:meth:`cached_fp8_tensors`, each first brought to the current weight version (re-quantized into its own
        buffers where the weight moved); no copy is made that the layer did not hold. Without ``transposes`` the
        W^T copies are left out of the list (a forward reads W alone): what a captured decode graph reads, and
        where."""
        self.refresh_cached_weights()
        if transposes:
            return self.cached_fp8_tensors()
        return [holder._qweight for holder, _ in self._holders() if holder._qweight is not None]

    def quantized_weight(self) -> Fp8Tensor:
        """The (128, 128)-block FP8 weight for the current weight version, quantized at most once."""
        return self._cached_weights(with_transpose=False)[0]

    def _cached_weights(self, with_transpose: bool) -> tuple[Fp8Tensor, Fp8Tensor | None]:
        """W's FP8 form (and W^T's with ``with_transpose``) for the current weight version (the layer's cache,
        :mod:`jetrl.quant.weight_cache`)."""
        return _stacked_weights(self, (self,), with_transpose)

    def forward(self, x: torch.Tensor, x_fp8: Fp8Tensor | None = None, *, exact: bool = False) -> torch.Tensor:
        """``x`` (..., in_features). ``x_fp8``: x flattened to 2-D and quantized per 1x128 with this layer's
        ``pow2_scale`` by a fused producer (see :func:`fp8_input_scaling`); ignored when not in FP8, and in FP8 the
        only values read (x's are not: the producer may leave them unwritten, ``swiglu(..., fp8_only=True)``).
        ``exact``: batch-invariant forward (exact on-policy mode, :mod:`jetrl.quant.exact`), in FP8 or not."""
        if not self.uses_fp8():
            return exact_linear(x, self.weight, self.bias) if exact else F.linear(x, self.weight, self.bias)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear expects inputs with {self.in_features} features in the last dim, "
                             f"got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"FP8Linear input must be a floating-point tensor, got {x.dtype}")
        flat = x.dim() == 2  # the packed (tokens, features) inputs of the models: no reshape either way
        x2d = x if flat else x.reshape(math.prod(x.shape[:-1]), self.in_features)
        if x_fp8 is not None and (x_fp8.block != ACT or x_fp8.shape != x2d.shape):
            raise ValueError(f"x_fp8 must be x's (1, 128) quantization of shape {tuple(x2d.shape)}, got "
                             f"block {x_fp8.block} and shape {tuple(x_fp8.shape)}")
        # with x_fp8 (x perhaps unwritten) a non-finite value of x shows in its 1x128 block's scale
        if self.check_finite and not bool(torch.isfinite(x if x_fp8 is None else x_fp8.scale).all()):
            raise FloatingPointError(f"non-finite values (NaN/Inf) in the input of {self!r}")
        qweight, qweight_t = self._cached_weights(with_transpose=_caches_transpose())
        bias = self.bias
        y = fp8_linear_group(x2d, [self.weight], [bias] if bias is not None else [], qweight, self.pow2_scale,
                             qweight_t, x_fp8, exact)
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, fp8_train={self.fp8_train}, fp8_rollout={self.fp8_rollout}"
                + (", pow2_scale=True" if self.pow2_scale else ""))


def _sharing(new: nn.Linear, old: nn.Linear) -> nn.Linear:
    """``new`` (built on the meta device) holding ``old``'s parameters, in ``old``'s training mode."""
    new.weight, new.bias = old.weight, old.bias
    return new.train(old.training)


def fp8_input_scaling(*modules: nn.Module) -> bool | None:
    """Whether a producer should hand these linears a pre-quantized input, and with which scaling.

    Returns the shared ``pow2_scale`` when every module is an :class:`FP8Linear` running FP8 on the
    current side (so each would quantize the same input per 1x128 with that scaling), else ``None``: then
    the producer emits no FP8 copy and the layers do what they always do.
    """
    if not modules or not all(isinstance(m, FP8Linear) and m.uses_fp8() for m in modules):
        return None
    scalings = {m.pow2_scale for m in modules}
    return scalings.pop() if len(scalings) == 1 else None


def call_linear(module: nn.Module, x: torch.Tensor, x_fp8: Fp8Tensor | None = None, *,
                exact: bool = False) -> torch.Tensor:
    """``module(x)``, passing ``x_fp8`` along to an :class:`FP8Linear` when there is one.

    ``exact``: the batch-invariant forward (:mod:`jetrl.quant.exact`): an :class:`FP8Linear` is asked for it,
    a plain ``nn.Linear`` runs :func:`~jetrl.quant.exact.exact_linear` on its parameters.
    """
    if isinstance(module, FP8Linear):
        return module(x, x_fp8, exact=exact)
    if not exact:
        return module(x)
    if type(module) is not nn.Linear:
        raise TypeError(f"exact mode needs nn.Linear or FP8Linear layers, got {type(module).__name__}")
    return exact_linear(x, module.weight, module.bias)


def forward_gemm_weights(model: nn.Module) -> list[GemmWeight]:
    """Every FP8 weight ``model``'s forwards have multiplied so far on the precision side in force (each once):
    what :func:`jetrl.quant.backend.prepare_gemms` compiles ahead for, e.g. before the rollout's decode graphs are
    captured (the prefill has run every layer by then)."""
    seen: dict[GemmWeight, None] = {}
    for layer in model.modules():
        if isinstance(layer, FP8Linear) and layer.uses_fp8():
            seen.update(dict.fromkeys(layer.forward_gemm_weights()))
    return list(seen)


def groupable(modules: tuple[nn.Module, ...] | list[nn.Module]) -> bool:
    """Whether these linears can run as one stacked FP8 linear: 2 or 3 :class:`FP8Linear` running FP8 on this
    side with one scaling, the same input width, dtype and device, widths of whole 128-row weight tiles (so the
    stacked weight's tiles are the members' tiles), and biases on all or none."""
    return 2 <= len(modules) <= 3 and fp8_input_scaling(*modules) is not None and _layouts_stack(tuple(modules))


def grouped_linear(modules: tuple[nn.Module, ...] | list[nn.Module], x: torch.Tensor,
                   x_fp8: Fp8Tensor | None = None, *, exact: bool = False) -> torch.Tensor | None:
    """The outputs of linears that read the same 2-D input (q/k/v, gate/up) side by side, (M, sum of widths), from
    one computation; ``None`` where they do not run grouped (the caller then runs them one by one).

    * Fast mode, :func:`groupable` layers: one stacked FP8 linear (:func:`fp8_linear_group`: one GEMM each way,
      grad_out quantized once, the saved input re-quantized once; gradients split back to each layer), from the
      group's stacked FP8 weight (:func:`_stacked_weights`), with or without grad. A no-grad input with ``x_fp8``
      goes first to the backend's ``grouped_gemm`` over each member's rows of that weight (the CUDA backend takes
      decode-sized inputs, in one launch, and declines the rest; the reference backend takes every size).
    * Plain ``nn.Linear`` layers (BF16) that stack (:func:`~jetrl.quant.weight_cache._bf16_stackable`), a
      decode-sized CUDA input (at most ``DECODE_GEMM_MAX_M`` rows) without grad: one GEMM over their stacked weight
      and bias (:class:`~jetrl.quant.weight_cache._Bf16Stack`, a copy made once per weight version); other inputs and
      layers run one by one (a prefill or a training forward, where one GEMM per layer costs no more).
    * ``exact``: a no-grad input with ``x_fp8`` through ``grouped_gemm_exact`` (the bits of each layer's own exact
      GEMM; the CUDA backend groups decode-sized inputs whose weights share exact mode's K split), over the members'
      own weights; otherwise ``None`` (each layer runs its batch-invariant forward).
    ``x_fp8``: x's 1x128 quantization with the layers' scaling (a fused producer's), else the layers quantize x.
    """
    if x.dim() != 2 or not 2 <= len(modules) <= 3:
        return None
    if fp8_input_scaling(*modules) is None:
        return _bf16_grouped(tuple(modules), x) if not exact else None
    if x_fp8 is not None and tuple(x_fp8.shape) != tuple(x.shape):
        raise ValueError(f"x_fp8 must be x's (1, 128) quantization of shape {tuple(x.shape)}, got {tuple(x_fp8.shape)}")
    backend = get_backend(x.device)
    if exact:
        if torch.is_grad_enabled() or x_fp8 is None:
            return None
        weights = [m.quantized_weight() for m in modules]
        out = backend.grouped_gemm_exact(x_fp8, weights, out_dtype=x.dtype)
        if out is None or all(m.bias is None for m in modules):
            return out
        return torch.cat([y + m.bias.to(y.dtype) if m.bias is not None else y  # each bias as FP8Linear adds it
                          for m, y in zip(modules, out.split([m.out_features for m in modules], dim=1))], dim=1)
    # groupable(modules), decided once per weight version (the side and scaling were checked above)
    modules = tuple(modules)
    cache = _group_cache(modules)
    key = tuple(m.weight_key() for m in modules)
    layout = (key, tuple(m.bias is None for m in modules))
    if cache.layout != layout:
        cache.layout, cache.stacks = layout, _layouts_stack(modules)
    if not cache.stacks:
        return None
    grad = torch.is_grad_enabled()
    qweight, qweight_t = _stacked_weights(cache, modules, with_transpose=grad and _caches_transpose(), key=key)
    if not grad and x_fp8 is not None:
        out = backend.grouped_gemm(x_fp8, _member_weights(qweight, modules), [m.bias for m in modules],
                                   out_dtype=x.dtype)
        if out is not None:
            return out
    biases = [m.bias for m in modules] if modules[0].bias is not None else []
    return fp8_linear_group(x, [m.weight for m in modules], biases, qweight, modules[0].pow2_scale, qweight_t, x_fp8)


def _bf16_grouped(modules: tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor | None:
    """:func:`grouped_linear` for plain linears: their stacked BF16 GEMM on a decode-sized no-grad ``x``, else None."""
    from jetrl.quant.kernels.tuning import DECODE_GEMM_MAX_M  # CPU-only; kernels import lazily (test_layering.py)

    # on a GPU one GEMM instead of two or three saves their launch latency; on the CPU the layers' own GEMMs keep
    # a row's result independent of the rows beside it (the CPU on-policy check, tests/rl/test_trainer.py)
    if (not x.is_cuda or torch.is_grad_enabled() or x.shape[0] > DECODE_GEMM_MAX_M
            or not _bf16_stackable(modules, x)):
        return None
    stack = bf16_stacked(modules)
    return F.linear(x, stack.weight, stack.bias)


def linears_shared_input(modules: tuple[nn.Module, ...] | list[nn.Module], x: torch.Tensor,
                         x_fp8: Fp8Tensor | None = None, *, exact: bool = False) -> list[torch.Tensor]:
    """``[m(x) for m in modules]`` for linears that read the same input (q/k/v, gate/up): column slices of
    :func:`grouped_linear`'s output where they run grouped, else each layer on its own (:func:`call_linear`)."""
    out = grouped_linear(modules, x, x_fp8, exact=exact)
    if out is not None:
        return list(out.split([m.out_features for m in modules], dim=1))
    return [call_linear(m, x, x_fp8, exact=exact) for m in modules]
