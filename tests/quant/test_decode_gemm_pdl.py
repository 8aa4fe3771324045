"""The decode GEMM as a programmatic dependent launch (``tuning.decode_gemm_pdl``), compiled for the H200 (sm_90a)
on the CPU machine.

With PDL the GEMM's programs may run while the kernel before it (which writes the GEMM's input) still runs, and
the kernel after the GEMM (a fused norm, SwiGLU, the 1x128 quantizer, RoPE) while the GEMM still runs. The result
stays the same bits only if each such kernel's ``griddepcontrol.wait`` comes before every load, store and atomic of
it. That is an ordering of the compiled code, checked here on the PTX of every launch form of the GEMM (pointer and
TMA loads, split and unsplit, grouped launches) and of the kernels around it, with each one's trigger after its
wait. The GPU tests (``tests/quant/test_decode_gemm_pdl_gpu.py``) check the bits against the launches without PDL,
eager and in a CUDA graph of the decode step's chain of kernels.
"""

from __future__ import annotations

import re

import pytest

from jetrl.quant.kernels.tuning import COMPILE_OPTIONS, KernelTuning, early_dependents
from sm90_compile import skip_without_sm90_compiler

# loads, stores, atomics and prefetches of global memory (TMA, bulk and cp.async copies included), predicated or not;
# a kernel's parameters are no one's writes, so ld.param may come first
# a branch ahead of the wait could let some programs skip it (a wait under a program-dependent condition)
_BRANCH = re.compile(r"^\s*(?:@!?%p\d+\s+)?bra(?:\.uni)?\s", re.M)
_MEMORY = re.compile(r"^\s*(?:@!?%p\d+\s+)?(ld\.global|ld\.weak|ld\.volatile|ld\.acquire|ld\.relaxed|st\.global|"
                     r"atom\.|red\.|cp\.async|cp\.reduce\.async|prefetch)", re.M)


def _compile(fn, consts: dict, types: dict, warps: int = 4, stages: int = 3) -> str:
    skip_without_sm90_compiler()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    signature = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=warps, num_stages=stages, **COMPILE_OPTIONS)).asm["ptx"]


def _gemm_ptx(pdl: bool, tma: bool, split: int, groups: int = 1) -> str:
    from jetrl.quant.kernels import gemm_decode_triton as G

    weight = "tensordesc<fp8e4nv[64, 128]>" if tma else "*fp8e4nv"
    types = {"a_ptr": "tensordesc<fp8e4nv[64, 128]>" if tma else "*fp8e4nv", "c_ptr": "*bf16", "as_ptr": "*fp32",
             "ws_ptr": "*fp32", "lock_ptr": "*i32"}
    for i in range(3):
        types |= {f"b{i}_ptr": weight, f"bs{i}_ptr": "*fp32", f"bias{i}_ptr": "*bf16"}
    consts = dict(KB_PER_SPLIT=32 // split, SPLIT_K=split, B_SCALE_ROWS=128, NUM_GROUPS=groups, HAS_BIAS=False,
                  BLOCK_M=64, BLOCK_N=64, M_TILES=1, K_UNROLL=1, USE_TMA=tma, PDL=pdl)
    return _compile(G._fp8_decode_gemm_kernel, consts, types)


@pytest.mark.parametrize("tma,split,groups", [(False, 1, 1), (False, 4, 1), (True, 1, 1), (True, 4, 1), (True, 4, 3),
                                              (False, 2, 2)])
def test_nothing_read_or_written_before_the_wait(tma, split, groups):
    ptx = _gemm_ptx(True, tma, split, groups)
    waits = [m.start() for m in re.finditer(r"griddepcontrol\.wait", ptx)]
    assert len(waits) == 1, waits
    before = [m.group(1) for m in _MEMORY.finditer(ptx[:waits[0]])]
    assert before == [], before  # no load, store or atomic ahead of the wait
    assert not _BRANCH.search(ptx[:waits[0]])  # and every program reaches it
    assert _MEMORY.search(ptx[waits[0]:])  # (the pattern does see the kernel's memory instructions)
    triggers = [m.start() for m in re.finditer(r"griddepcontrol\.launch_dependents", ptx)]
    assert len(triggers) == 1 and triggers[0] > waits[0]  # the kernel after it may launch once it has waited


def test_off_means_no_wait():
    assert "griddepcontrol" not in _gemm_ptx(False, True, 4)


def test_kernels_around_the_gemm_wait_first():
    """The fused norm, SwiGLU and the 1x128 quantizer (before and after a decode GEMM) wait for the kernel before them
    before their first memory access, then trigger their dependents; RoPE (after the q/k/v GEMM) only waits."""
    from jetrl.quant.kernels import norm_triton, quantize_triton, rope_triton, swiglu_triton

    norm = dict(HAS_RES=True, QUANT=True, POW2=True, BLOCK_M=1, BLOCK_D=4096, NUM_CHUNKS=1, QG=128)
    norm_types = {n: "*bf16" for n in ("x_ptr", "r_ptr", "w_ptr", "out_ptr", "h_ptr")} | {
        "rstd_ptr": "*fp32", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "eps": "fp32"}
    swiglu = dict(POW2=True, QUANTIZE=True, BLOCK_M=16)
    swiglu_types = {"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*fp8e4nv",
                    "scale_ptr": "*fp32"}
    quant = dict(POW2=True, ROWS=True, BLOCK_M=32, BLOCK_K=128)
    quant_types = {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    rope = dict(BACKWARD=False, BLOCK_HQ=16, BLOCK_HK=2, BLOCK_HALF=64)
    rope_types = {n: "*bf16" for n in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr")} | {"cos_ptr": "*fp32",
                                                                                      "sin_ptr": "*fp32"}
    for fn, consts, types in ((norm_triton._rms_norm_fwd_kernel, norm, norm_types),
                              (swiglu_triton._swiglu_fwd_kernel, swiglu, swiglu_types),
                              (quantize_triton._quantize_rows_cols_kernel, quant, quant_types),
                              (rope_triton._rope_qk_kernel, rope, rope_types)):
        on = _compile(fn, consts | {"PDL": True}, types)
        off = _compile(fn, consts | {"PDL": False}, types)
        assert on.count("griddepcontrol.wait") == 1 and "griddepcontrol" not in off, fn.__name__
        wait = on.index("griddepcontrol.wait")
        assert not _MEMORY.search(on[:wait]), fn.__name__  # at the start, before the kernel's first access
        assert not _BRANCH.search(on[:wait]), fn.__name__  # and every program reaches it
        assert _MEMORY.search(on[wait:]), fn.__name__
        triggers = [m.start() for m in re.finditer(r"griddepcontrol\.launch_dependents", on)]
        want = 0 if fn is rope_triton._rope_qk_kernel else 1
        assert len(triggers) == want and all(t > wait for t in triggers), fn.__name__


def test_pdl_field_checked_and_only_on_the_gpu(monkeypatch):
    import torch

    with pytest.raises(ValueError, match="decode_gemm_pdl"):
        KernelTuning(decode_gemm_pdl=1)
    assert not early_dependents(torch.device("cpu"))
    # the interpreter has no programmatic launch, on CUDA tensors either (the capability is not even asked)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: pytest.fail("capability asked"))
    assert not early_dependents(torch.device("cuda", 0))


class _Recorder:
    """Stands in for the Triton kernel: records the launch keywords of each call."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append(kw)


@pytest.mark.parametrize("on", [True, False])
def test_launch_flag_and_wait_travel_together(monkeypatch, on):
    """Where PDL is on, the kernel is compiled with its wait (``PDL``) and launched with ``launch_pdl``; where off,
    neither: a launch attribute without the wait would let the GEMM read its input early."""
    import torch

    from jetrl.quant.kernels import gemm_decode_triton as dk
    from jetrl.quant.kernels import tuning

    recorder = _Recorder()
    monkeypatch.setattr(dk, "_fp8_decode_gemm_kernel", recorder)
    monkeypatch.setattr(tuning, "early_dependents", lambda device: on)
    a = torch.zeros(16, 256, dtype=torch.float8_e4m3fn)
    w = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    dk.fp8_decode_gemm(a, torch.ones(16, 2), w, torch.ones(1, 2), 128)
    dk.fp8_decode_gemm_grouped(a, torch.ones(16, 2), [(w, torch.ones(1, 2), None)] * 2)
    assert [kw["PDL"] for kw in recorder.launches] == [on, on]
    assert [kw.get("launch_pdl", False) for kw in recorder.launches] == [on, on]


@pytest.mark.parametrize("on", [True, False])
def test_kernels_around_the_gemm_launch_as_dependents_with_their_wait(monkeypatch, on):
    """The fused norm, SwiGLU, the 1x128 quantizer and RoPE: compiled with their wait (``PDL``) exactly where they are
    launched with ``launch_pdl``; the norm and SwiGLU only where they quantize (an FP8 GEMM reads them), else plainly
    (in ``bf16`` cuBLAS's kernels surround them)."""
    import torch

    from jetrl.quant.kernels import norm_triton, quantize_triton, rope_triton, swiglu_triton, tuning

    recorders = {}
    for module, name in ((norm_triton, "_rms_norm_fwd_kernel"), (swiglu_triton, "_swiglu_fwd_kernel"),
                         (quantize_triton, "_quantize_rows_cols_kernel"), (rope_triton, "_rope_qk_kernel")):
        recorders[name] = _Recorder()
        monkeypatch.setattr(module, name, recorders[name])
    monkeypatch.setattr(tuning, "early_dependents", lambda device: on)
    x = torch.randn(37, 256).to(torch.bfloat16)
    norm_triton.rms_norm_forward(x, x, torch.ones(256, dtype=torch.bfloat16), 1e-5, quantize=True, pow2_scale=True)
    swiglu_triton.swiglu_fwd(x, x, quantize=True, pow2_scale=True)
    quantize_triton.quantize_act_1x128(x, pow2_scale=True)
    rope_triton.rope_qk(x.view(37, 4, 64), x.view(37, 4, 64)[:, :2], torch.ones(37, 64), torch.zeros(37, 64))
    norm_triton.rms_norm_forward(x, x, torch.ones(256, dtype=torch.bfloat16), 1e-5)
    swiglu_triton.swiglu_fwd(x, x)
    for name, recorder in recorders.items():
        want = [on, False] if name in ("_rms_norm_fwd_kernel", "_swiglu_fwd_kernel") else [on]
        assert [kw["PDL"] for kw in recorder.launches] == want, name
        assert [kw.get("launch_pdl", False) for kw in recorder.launches] == want, name


@pytest.mark.parametrize("capability, pdl, want", [((8, 0), True, False), ((8, 9), True, False), ((9, 0), True, True),
                                                   ((10, 0), True, True), ((9, 0), False, False)])
def test_pdl_only_from_hopper_on(monkeypatch, capability, pdl, want):
    """``griddepcontrol`` is sm_90's: on an Ampere or Ada GPU none of the waits and triggers of the decode GEMM and
    the kernels around it is compiled (the bf16 recipe runs the fused norm and SwiGLU there too)."""
    import torch

    from jetrl.quant.kernels import tuning

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    tuning._hopper_or_later.cache_clear()
    try:
        with tuning.override(decode_gemm_pdl=pdl):
            assert early_dependents(torch.device("cuda", 0)) is want
    finally:
        tuning._hopper_or_later.cache_clear()
