"""DeepGEMM's blockwise FP8 GEMMs on Hopper: the rollout's decode GEMMs where DeepGEMM loads (tuning ``gemm``
``"auto"``, the default, or ``"deepgemm"``, which requires it).

`DeepGEMM <https://github.com/deepseek-ai/DeepGEMM>`_ (DeepSeek's CUDA library, built from source with the CUDA
toolkit; its kernels are compiled at first use and cached on disk) multiplies E4M3 operands with fp32 block scales
in persistent, warp-specialized kernels that promote the scaled partial sums in registers. It computes what cuBLAS's
blockwise ``scaled_mm`` computes (:mod:`~jetrl.quant.kernels.gemm_scaled_mm`) with other kernels. Its results differ
from cuBLAS's only in the fp32 summation order, as two cuBLAS algorithms' would; exact mode's forward GEMMs never
come here (they are fixed per shape).

The rollout's Fprop ``x @ W^T`` maps onto its ``fp8_gemm_nt(a, b, d)`` (``d = a @ b.T``): ``a`` 1x128 (its scales
MN-major and TMA-aligned: M rounded up to 4, which is how jetrl's 1x128 producers allocate them, so the GEMM runs on
the padded rows as the cuBLAS route does), ``b`` 128x128 tiles (scales contiguous), BF16 ``d``; the kernel is
compiled per (N, K), M is a runtime argument.

The routing rule (:func:`route`) lives here; :func:`jetrl.quant.kernels.cuda_backend.gemm_path` asks it where the
tuning routes to DeepGEMM (:meth:`~jetrl.quant.kernels.tuning.KernelTuning.uses_deepgemm`: under ``"auto"`` where
:func:`is_available`; DeepGEMM is built from source, or installed as the PyPI build for the running torch, which
:mod:`~jetrl.quant.kernels.deepgemm_builds` checks, e.g. by the extra ``jetrl[deepgemm-torch2-11]``). DeepGEMM
picks its tile sizes per call from M, so a run meets a kernel per (shape, tile configuration): :func:`compile_kernels`
compiles a run's set ahead, in parallel processes, into the disk cache (``DG_JIT_CACHE_DIR``, default
``~/.deep_gemm``) that every later process reads (:func:`jetrl.quant.backend.prepare_gemms`, which the rollout's
decode graphs call at their first capture).
Without CUDA graphs a kernel compiles when first met (seconds, once per machine through the disk cache).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch

from jetrl.quant.formats import ACT, E4M3, WEIGHT, Fp8Tensor
from jetrl.quant.kernels import deepgemm_builds as builds
from jetrl.quant.kernels import gemm_scaled_mm as scaled_mm


@functools.lru_cache(maxsize=None)
def _module():
    """The ``deep_gemm`` module, or None where it is not installed, is a PyPI build for another torch
    (:func:`~jetrl.quant.kernels.deepgemm_builds.problem`, checked before the import, which already calls into the
    build's module) or does not load (said once, as a warning)."""
    if importlib.util.find_spec("deep_gemm") is None:
        return None
    problem = builds.problem()
    if problem is not None:
        warnings.warn(f"DeepGEMM is installed but cannot run here: {problem}", RuntimeWarning, stacklevel=2)
        return None
    try:
        return importlib.import_module("deep_gemm")
    except (ImportError, OSError, RuntimeError) as exc:
        warnings.warn(f"DeepGEMM is installed but does not load ({type(exc).__name__}: {exc})", RuntimeWarning,
                      stacklevel=2)
        return None


def installed() -> bool:
    """Whether ``deep_gemm`` imports."""
    return _module() is not None


def is_available(device: torch.device) -> bool:
    """DeepGEMM's FP8 GEMMs here: ``deep_gemm`` loads and ``device`` is a compute-capability 9.0 GPU (its fp32-scale
    kernels are Hopper's; Blackwell's take UE8M0 scales, another recipe)."""
    return scaled_mm.is_available(device) and installed()


def supports(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype) -> bool:
    """Whether ``a @ b.T`` is a GEMM this route runs: 1x128 ``a`` times a weight of 128x128 tiles with a BF16
    output (DeepGEMM's 1D2D kernels write BF16 only), within cuBLAS's layout rules
    (:func:`gemm_scaled_mm.supports`: K a multiple of 128, N of 128)."""
    return a.block == ACT and b.block == WEIGHT and out_dtype == torch.bfloat16 and scaled_mm.supports(a, b)


def route(m: int, n: int, k: int, *, decode_max_m: int = 0, split_k_max_m: int = 0,
          decode_bound: int = 0) -> str | None:
    """Where DeepGEMM's rule sends ``a`` (m, k) @ ``b`` (n, k)^T that DeepGEMM's layouts take (:func:`supports`):
    ``"deepgemm"``, ``"decode"`` (jetrl's split-K decode kernel keeps it) or None (the default route decides: the
    decode kernel up to its bound, cuBLAS above). The bounds are the tuning's
    (:meth:`~jetrl.quant.kernels.tuning.KernelTuning.deepgemm_rule`); ``decode_bound``: rows up to which the
    caller's launch is better on the decode kernel whatever its shape (a grouped launch with biases, which that
    kernel adds in its epilogue and DeepGEMM cannot; 0: none).

    The rule reads the GEMM's shape alone, not which phase runs it. A GEMM of at most ``decode_max_m`` rows (a
    rollout's decode step) goes to DeepGEMM, whose persistent kernel is faster there than both cuBLAS's blockwise
    GEMM and the split-K decode kernel, except on weights whose K is more than twice their N (an MLP's down
    projection) up to ``split_k_max_m`` rows, which stay on the decode kernel: their few output tiles leave most SMs
    idle over a long K unless K is split, which DeepGEMM does not do (BENCHMARKS.md, "FP8 kernels"). Every larger
    GEMM (prefill, the trainer's micro-batches, their DGrad) is left to the default route, where DeepGEMM was no
    faster in a whole 1.5B run. WGrad never reaches here (its right operand is not a weight: :func:`supports`).
    """
    if m > decode_max_m:
        return None
    if (k > 2 * n and m <= split_k_max_m) or m <= decode_bound:
        return "decode"
    return "deepgemm"


def gemm(a: Fp8Tensor, b: Fp8Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``a @ b.T`` on DeepGEMM; ``a`` 1x128, ``b`` 128x128 tiles, a BF16 output; check :func:`supports` first."""
    if not supports(a, b, out_dtype):
        raise ValueError(f"DeepGEMM does not take a {tuple(a.shape)} {a.block} x b {tuple(b.shape)} {b.block} -> "
                         f"{out_dtype}; a 1x128 times b 128x128 to BF16, K and N multiples of 128")
    dg = _module()
    m = a.shape[0]
    a_data, a_scale = scaled_mm.act_operand(a)
    rows = a_data.shape[0]
    b_data = b.data if b.data.is_contiguous() else b.data.contiguous()
    out = torch.empty((rows, b.shape[0]), dtype=torch.bfloat16, device=a.data.device)
    # compiled per (N, K), M at run time: DeepGEMM 2.6.1's default, which the PyPI builds' wrapper does not share
    dg.fp8_gemm_nt((a_data, a_scale), (b_data, b.scale.contiguous()), out, compiled_dims="nk")
    return out[:m] if rows != m else out


# ---------------------------------------------------------------------------------------------- compiling ahead


@dataclass(frozen=True)
class GemmShape:
    """One GEMM a run will launch: ``m`` rows of a 1x128 ``a`` times an (``n``, ``k``) ``b`` of 128x128 tiles."""

    m: int
    n: int
    k: int


def _zeros_operands(shape: GemmShape, device: torch.device) -> tuple[Fp8Tensor, Fp8Tensor]:
    """Operands of ``shape`` in jetrl's layouts (zero data, unit scales): enough to compile and launch a kernel."""
    m, n, k = shape.m, shape.n, shape.k
    a = Fp8Tensor(torch.zeros((m, k), dtype=E4M3, device=device), torch.ones((k // 128, m), device=device).t(), ACT)
    b = Fp8Tensor(torch.zeros((n, k), dtype=E4M3, device=device),
                  torch.ones((n // 128, k // 128), device=device), WEIGHT)
    return a, b


def _takes(shape: GemmShape) -> bool:
    """Whether :func:`supports` takes ``shape``'s operands (K in whole 128-blocks, N in whole 128x128 tiles)."""
    return shape.m > 0 and shape.k > 0 and shape.k % 128 == 0 and shape.n % 128 == 0


def _launch_all(device_index: int, shapes: list[GemmShape]) -> None:
    device = torch.device("cuda", device_index)
    for shape in shapes:
        a, b = _zeros_operands(shape, device)
        gemm(a, b)
    torch.cuda.synchronize(device)


def default_workers() -> int:
    """Compile workers per process: this machine's CPUs shared by the processes of the job on it
    (``LOCAL_WORLD_SIZE``, set by ``torchrun``; 1 otherwise), at most 8 (each worker holds a CUDA context on its
    process's GPU), at least 1."""
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(8, (os.cpu_count() or 1) // local))


def compile_kernels(shapes: list[GemmShape], device: torch.device, processes: int | None = None,
                    timeout: float = 900.0) -> float:
    """Launch every GEMM of ``shapes`` once in ``processes`` worker processes (default: :func:`default_workers`),
    so that each kernel they need is compiled into DeepGEMM's disk cache, then once here, which loads each kernel (a
    load is quick, and kept out of a CUDA-graph capture that meets the shape later); returns the seconds taken. The
    shapes, ordered by (N, K) and then M, are cut into equal slices, one per worker, so neighbouring M (which mostly
    share a tile configuration) compile in one worker. Shapes DeepGEMM does not take are skipped. A worker that fails
    or outlives ``timeout`` seconds is reported as a warning (and stopped): its kernels are then compiled here, one
    by one."""
    shapes = {s for s in shapes if _takes(s)} - _PREPARED
    if not shapes or not is_available(device):
        return 0.0
    start = time.perf_counter()
    ordered = sorted(shapes, key=lambda s: (s.n, s.k, s.m))
    workers = max(1, min(processes or default_workers(), len(ordered)))
    chunks = [ordered[i * len(ordered) // workers:(i + 1) * len(ordered) // workers] for i in range(workers)]
    index = device.index if device.index is not None else torch.cuda.current_device()
    if workers > 1:  # fresh interpreters (not multiprocessing: it would re-run the parent's __main__)
        procs = []
        try:
            for chunk in chunks:
                log = tempfile.TemporaryFile("w+")
                procs.append((subprocess.Popen([sys.executable, "-m", __name__, str(index),
                                                json.dumps([dataclasses.astuple(s) for s in chunk])],
                                               stdout=subprocess.DEVNULL, stderr=log, text=True), log))
            for proc, log in procs:
                try:
                    code = proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - start)))
                    failed = f"exit {code}" if code else ""
                except subprocess.TimeoutExpired:
                    failed = f"no exit within {timeout:.0f} s"
                if failed:
                    log.seek(0)
                    warnings.warn(f"a DeepGEMM compile worker failed ({failed}): {log.read().strip()[-500:]}",
                                  RuntimeWarning, stacklevel=2)
        finally:
            for proc, log in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
                log.close()
    with torch.cuda.device(index):
        _launch_all(index, ordered)
    _PREPARED.update(ordered)
    return time.perf_counter() - start


# the launches :func:`compile_kernels` has compiled and loaded in this process
_PREPARED: set[GemmShape] = set()


def planned_shapes(token_counts: list[int], weights: set[tuple[int, int]], *, decode_bound=None,
                   **rule: int) -> list[GemmShape]:
    """The DeepGEMM launches that GEMMs of the (N, K) ``weights`` make at each of ``token_counts`` rows, by
    :func:`route` with the bounds ``rule``; ``decode_bound(n, k)`` gives a weight's ``decode_bound`` (default 0)."""
    return [GemmShape(m, n, k) for n, k in sorted(weights) for m in token_counts
            if route(m, n, k, decode_bound=0 if decode_bound is None else decode_bound(n, k), **rule) == "deepgemm"]


if __name__ == "__main__":  # a compile worker of compile_kernels: DEVICE_INDEX JSON_SHAPES
    _launch_all(int(sys.argv[1]), [GemmShape(*t) for t in json.loads(sys.argv[2])])
