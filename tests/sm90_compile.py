"""Offline sm_90a compiles in CPU tests: skip only where the installed Triton cannot compile for the H200.

The tests that compile a kernel for sm_90a on the CPU machine (to read its PTX or SASS) call
:func:`skip_without_sm90_compiler` first, and nothing else turns a failure into a skip: a kernel whose signature
changed, or a compile that fails, fails the test (a blanket ``except Exception: skip`` once hid exactly that).
"""

from __future__ import annotations

import importlib.util

import pytest


def skip_without_sm90_compiler() -> None:
    """Skip the calling test where Triton is missing or has no NVIDIA backend (the offline PTX/cubin compiler)."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install triton)")
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("this Triton has no NVIDIA backend: cannot compile for sm_90a here")
