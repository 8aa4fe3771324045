"""Every kernel launch of jetrl states its floating-point contraction (``tuning.COMPILE_OPTIONS``, or
``enable_fp_fusion=False`` where a kernel matches a reference without fma): it is part of the kernels' arithmetic
(their bitwise contracts were established with it so), and Triton's own default for it comes from the environment
and is announced to change."""

import importlib.util
import pathlib
import re

import pytest

from jetrl.quant.kernels import tuning

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "jetrl" / "quant" / "kernels"
# a launch: ``name_kernel[grid](`` or ``_kernels()[i][grid](`` (the Gluon kernels, built lazily)
LAUNCH = re.compile(r"(?:\w+_kernel|_kernels\(\)\[\d\])\[")


def _launches(text: str) -> list[str]:
    """The argument text of every kernel launch in ``text`` (brackets matched, comments and definitions skipped)."""
    calls = []
    for m in LAUNCH.finditer(text):
        line = text[text.rfind("\n", 0, m.start()) + 1:m.start()]
        if line.lstrip().startswith("#") or "def " in line:
            continue
        i, depth = m.end(), 1
        while depth:
            depth += {"[": 1, "]": -1}.get(text[i], 0)
            i += 1
        if text[i] != "(":
            continue
        j, depth = i + 1, 1
        while depth:
            depth += {"(": 1, ")": -1}.get(text[j], 0)
            j += 1
        calls.append(text[i:j])
    return calls


def test_every_kernel_launch_pins_the_compile_options():
    found = {}
    for path in sorted(KERNELS.glob("*.py")):
        for call in _launches(path.read_text()):
            found.setdefault(path.name, []).append("**COMPILE_OPTIONS" in call or "enable_fp_fusion=False" in call)
    assert sum(len(v) for v in found.values()) >= 27, found  # the launches of the kernels folder
    missing = {name: flags for name, flags in found.items() if not all(flags)}
    assert not missing, f"kernel launches that leave contraction to Triton's default: {missing}"


def test_compile_options_keep_contraction_on_whatever_the_environment(monkeypatch):
    """The options override ``TRITON_DEFAULT_FP_FUSION=0`` (a user's environment, or a future Triton default)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    from triton.backends.compiler import GPUTarget

    try:
        from triton.backends.nvidia.compiler import CUDABackend
    except ImportError as exc:  # a Triton without the NVIDIA backend
        pytest.skip(f"no NVIDIA backend: {exc!r:.100}")
    assert dict(tuning.COMPILE_OPTIONS) == {"enable_fp_fusion": True}
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    backend = CUDABackend(GPUTarget("cuda", 90, 32))
    assert backend.parse_options({}).enable_fp_fusion is False  # what an unpinned launch would compile with
    assert backend.parse_options(dict(tuning.COMPILE_OPTIONS)).enable_fp_fusion is True
