"""FP8 numerics of jetrl: blockwise E4M3 quantization, FP8 GEMMs, FP8Linear and precision recipes.

Imports nothing else from jetrl. The layout: the specification (:mod:`~jetrl.quant.formats`,
:mod:`~jetrl.quant.reference`), the layer (the op :mod:`~jetrl.quant.linear_op`, the module
:mod:`~jetrl.quant.linear`, :mod:`~jetrl.quant.side`, the fused :mod:`~jetrl.quant.norm` and
:mod:`~jetrl.quant.swiglu`), the recipes (:mod:`~jetrl.quant.recipe`), and the seam
(:mod:`jetrl.quant.backend`), which picks the PyTorch reference or the kernels for every op. The kernels and
their tuning live one folder down, in :mod:`jetrl.quant.kernels`, imported only through the seam.
"""

from jetrl.quant.backend import fused_impl, gemm, get_backend, quantize, set_backend, use_backend
from jetrl.quant.formats import ACT, E4M3, TOKEN, WEIGHT, Fp8Tensor, dequantize
from jetrl.quant.linear import FP8Linear, call_linear, fp8_input_scaling, grouped_linear, linears_shared_input
from jetrl.quant.recipe import (PrecisionRecipe, apply_recipe, fp8_linears, fp8_weight_bytes, get_recipe,
                                refresh_fp8_weights)
from jetrl.quant.reference import quantize_tensor
from jetrl.quant.side import current_side, precision_side
from jetrl.quant.weight_cache import bf16_stacks

__all__ = [
    "ACT", "WEIGHT", "TOKEN", "E4M3", "Fp8Tensor",
    "quantize", "dequantize", "gemm", "quantize_tensor",
    "FP8Linear", "fp8_input_scaling", "call_linear", "linears_shared_input", "grouped_linear", "bf16_stacks",
    "PrecisionRecipe", "get_recipe", "apply_recipe", "fp8_linears", "fp8_weight_bytes", "refresh_fp8_weights",
    "precision_side", "current_side",
    "get_backend", "set_backend", "use_backend", "fused_impl",
]
