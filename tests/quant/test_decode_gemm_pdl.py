"""The decode GEMM as a programmatic dependent launch (``tuning.decode_gemm_pdl``), compiled for the H200 (sm_90a)
on the CPU machine.

With PDL the GEMM's programs may run while the kernel before it (which writes the GEMM's input) still runs. The
result stays the same bits only if ``griddepcontrol.wait`` comes before every load, store and atomic of the
kernel. That is an ordering of the compiled code, checked here on the PTX of every launch form (pointer and TMA
loads, split and unsplit, grouped launches), with the trigger of the kernels that feed the GEMM. The GPU tests
(``tests/quant/test_decode_gemm_pdl_gpu.py``) check the bits against the launch without PDL, eager and in a CUDA
graph behind the kernels that trigger their dependents early.
"""

from __future__ import annotations

import re

import pytest

from jetrl.quant.kernels.tuning import COMPILE_OPTIONS, KernelTuning, early_dependents
from sm90_compile import skip_without_sm90_compiler

# loads, stores, atomics and prefetches of global memory (TMA, bulk and cp.async copies included), predicated or not;
# a kernel's parameters are no one's writes, so ld.param may come first
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
    assert _MEMORY.search(ptx[waits[0]:])  # (the pattern does see the kernel's memory instructions)


def test_off_means_no_wait():
    assert "griddepcontrol" not in _gemm_ptx(False, True, 4)


def test_feeding_kernels_trigger_their_dependents():
    """The fused norm, SwiGLU and the 1x128 quantizer (the kernels before a decode GEMM) trigger at their start."""
    from jetrl.quant.kernels import norm_triton, quantize_triton, swiglu_triton

    norm = dict(HAS_RES=True, QUANT=True, POW2=True, BLOCK_M=1, BLOCK_D=4096, NUM_CHUNKS=1, QG=128)
    norm_types = {n: "*bf16" for n in ("x_ptr", "r_ptr", "w_ptr", "out_ptr", "h_ptr")} | {
        "rstd_ptr": "*fp32", "q_ptr": "*fp8e4nv", "qs_ptr": "*fp32", "eps": "fp32"}
    swiglu = dict(POW2=True, QUANTIZE=True, BLOCK_M=16)
    swiglu_types = {"gate_ptr": "*bf16", "up_ptr": "*bf16", "out_ptr": "*bf16", "q_ptr": "*fp8e4nv",
                    "scale_ptr": "*fp32"}
    quant = dict(POW2=True, ROWS=True, BLOCK_M=32, BLOCK_K=128)
    quant_types = {"x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    for fn, consts, types in ((norm_triton._rms_norm_fwd_kernel, norm, norm_types),
                              (swiglu_triton._swiglu_fwd_kernel, swiglu, swiglu_types),
                              (quantize_triton._quantize_rows_cols_kernel, quant, quant_types)):
        on = _compile(fn, consts | {"LAUNCH_DEPS": True}, types)
        off = _compile(fn, consts | {"LAUNCH_DEPS": False}, types)
        assert on.count("griddepcontrol.launch_dependents") == 1 and "griddepcontrol" not in off, fn.__name__
        trigger = on.index("griddepcontrol.launch_dependents")
        assert not _MEMORY.search(on[:trigger]), fn.__name__  # at the start, before the kernel's first access


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


@pytest.mark.parametrize("capability, pdl, want", [((8, 0), True, False), ((8, 9), True, False), ((9, 0), True, True),
                                                   ((10, 0), True, True), ((9, 0), False, False)])
def test_pdl_only_from_hopper_on(monkeypatch, capability, pdl, want):
    """``griddepcontrol`` is sm_90's: on an Ampere or Ada GPU neither the feeding kernels' trigger nor the GEMM's
    wait is compiled (the bf16 recipe runs the fused norm and SwiGLU there too)."""
    import torch

    from jetrl.quant.kernels import tuning

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    tuning._hopper_or_later.cache_clear()
    try:
        with tuning.override(decode_gemm_pdl=pdl):
            assert early_dependents(torch.device("cuda", 0)) is want
    finally:
        tuning._hopper_or_later.cache_clear()
