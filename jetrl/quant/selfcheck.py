"""FP8Linear against BF16 ``nn.Linear`` on random data: error always, speed on a GPU.

The quickest end-to-end check of the numerics on a new machine (``jetrl check-fp8``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from jetrl.quant.backend import get_backend
from jetrl.quant.linear import FP8Linear


def relative_error(ref: torch.Tensor, x: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in fp64."""
    ref, x = ref.double(), x.double()
    return float((x - ref).norm() / ref.norm())


@dataclass
class LinearCheck:
    shape: tuple[int, int, int]
    backend: str
    device: str
    rel_err_out: float
    rel_err_grad_input: float
    rel_err_grad_weight: float
    bf16_ms: float | None = None
    fp8_ms: float | None = None

    def rows(self) -> list[tuple[str, str]]:
        m, n, k = self.shape
        rows = [("shape (M, N, K)", f"{m} x {n} x {k}"), ("device / backend", f"{self.device} / {self.backend}"),
                ("rel. error output", f"{self.rel_err_out:.4f}"),
                ("rel. error grad_input", f"{self.rel_err_grad_input:.4f}"),
                ("rel. error grad_weight", f"{self.rel_err_grad_weight:.4f}")]
        if self.bf16_ms is not None and self.fp8_ms is not None:
            rows += [("fwd+bwd BF16 (ms)", f"{self.bf16_ms:.3f}"), ("fwd+bwd FP8 (ms)", f"{self.fp8_ms:.3f}"),
                     ("speed-up", f"{self.bf16_ms / self.fp8_ms:.2f}x")]
        return rows


def _median_ms(fn, warmup: int = 5, iters: int = 20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def check_fp8_linear(m: int = 512, n: int = 768, k: int = 1024, device: str | None = None,
                     seed: int = 0) -> LinearCheck:
    """Run one FP8Linear and one BF16 nn.Linear forward+backward on the same random data."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(seed)
    ref = nn.Linear(k, n, device=device, dtype=torch.bfloat16)
    fp8 = FP8Linear.from_linear(nn.Linear(k, n, device=device, dtype=torch.bfloat16))
    fp8.load_state_dict(ref.state_dict())
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    g = torch.randn(m, n, device=device, dtype=torch.bfloat16)
    outs = []
    for layer in (ref, fp8):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(g)
        outs.append((y.detach(), xi.grad, layer.weight.grad.clone()))
        layer.weight.grad = None
    result = LinearCheck((m, n, k), get_backend(device).name, str(device),
                         *(relative_error(a, b) for a, b in zip(*outs)))
    if str(device).startswith("cuda"):
        xg = x.clone().requires_grad_()
        result.bf16_ms = _median_ms(lambda: ref(xg).backward(g))
        result.fp8_ms = _median_ms(lambda: fp8(xg).backward(g))
    return result
