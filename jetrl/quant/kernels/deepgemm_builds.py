"""Which DeepGEMM can run under this torch, read without importing it: the PyPI builds (``sgl-deep-gemm``) per torch.

DeepGEMM's module is a C++ extension compiled against one torch. Built from source it matches the torch it was
built with; a PyPI build of ``sgl-deep-gemm`` names no torch in its metadata, yet runs on one only. On another torch
it loads, but its inlined tensor accessors read another tensor layout: every tensor it is given looks 0-dimensional
and its first check fails, or a missing symbol aborts the process (docs/recipes.md). This module holds the table
of builds and the check, so that the tuning object (:mod:`~jetrl.quant.kernels.tuning`) refuses ``gemm=deepgemm``
as a config error before a model loads, and the route (:mod:`~jetrl.quant.kernels.gemm_deepgemm`) never imports a
build for another torch. It imports nothing of jetrl and neither DeepGEMM nor Triton.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import warnings

import torch
from packaging.version import Version

# The torch (major, minor) each PyPI build of DeepGEMM (``sgl-deep-gemm``) is compiled against, which its metadata does
# not name: read off the line numbers of torch's headers in the assertion messages baked into each build's module
# (c10/core/SymInt.h, c10/util/intrusive_ptr.h, c10/core/TensorImpl.h), against torch 2.11-2.15's headers. Every
# release to 0.2.5 but 0.0.1rc0 and 0.0.1rc1 (no torch headers in them).
SGL_DEEP_GEMM_TORCH = {
    **dict.fromkeys(("0.0.1", "0.1.0rc0", "0.1.0", "0.1.1", "0.1.2", "0.1.3rc0", "0.1.3rc1", "0.1.3", "0.1.4rc0",
                     "0.1.4rc1", "0.1.4", "0.1.4.post1", "0.1.5rc0", "0.1.5rc2", "0.1.5rc3", "0.1.5", "0.1.5.post1"),
                    (2, 11)),
    **dict.fromkeys(("0.1.5rc1", "0.1.5rc4", "0.1.5.post2", "0.1.5.post3", "0.1.6", "0.1.7rc0", "0.1.7", "0.2.0rc0",
                     "0.2.0", "0.2.1"), (2, 13)),
    **dict.fromkeys(("0.1.8rc0", "0.2.1rc0", "0.2.1rc1", "0.2.1.post1", "0.2.2", "0.2.3", "0.2.3.post1",
                     "0.2.3.post2", "0.2.5"), (2, 14)),
    **dict.fromkeys(("0.2.3rc0", "0.2.4rc0"), (2, 15)),
}
# The build each torch's extra (``jetrl[deepgemm-torch2-11]``, ...) pins and the messages name: torch 2.11's is the
# one jetrl's GPU tests ran (docs/recipes.md); elsewhere the newest build in the table is named.
RECOMMENDED = {(2, 11): "0.1.4.post1", (2, 13): "0.2.1"}


def _major_minor(torch_version: str) -> tuple[int, int]:
    major, minor = torch_version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def build_problem(sgl_version: str | None, torch_version: str) -> str | None:
    """Why ``sgl-deep-gemm`` ``sgl_version`` cannot run on ``torch_version``, or None: where it is another torch's
    build (:data:`SGL_DEEP_GEMM_TORCH`). None for DeepGEMM built from source (``sgl_version`` None: compiled against
    the torch it runs on) and for a build not in the table."""
    built = SGL_DEEP_GEMM_TORCH.get(sgl_version) if sgl_version else None
    here = _major_minor(torch_version)
    if built is None or built == here:
        return None
    return (f"sgl-deep-gemm {sgl_version} is built against torch {built[0]}.{built[1]}, "
            f"not this torch {torch_version}; " + builds_for(torch_version))


def builds_for(torch_version: str) -> str:
    """The clause naming the ``sgl-deep-gemm`` releases for ``torch_version`` (final releases, oldest first; the
    count of pre-releases) and the pip command for the one to install (:data:`RECOMMENDED`, else the newest final
    release, else the newest pre-release), or that none is known."""
    here = _major_minor(torch_version)
    matching = sorted((v for v, t in SGL_DEEP_GEMM_TORCH.items() if t == here), key=Version)
    if not matching:
        return f"no sgl-deep-gemm build is known for torch {here[0]}.{here[1]}"
    final = [v for v in matching if not Version(v).is_prerelease]
    pre = len(matching) - len(final)
    if not final:
        listed = ", ".join(matching) + " (pre-releases)"
    else:
        listed = ", ".join(final) + (f" and {pre} pre-release{'s' * (pre > 1)}" if pre else "")
    pick = RECOMMENDED.get(here, (final or matching)[-1])
    return f"sgl-deep-gemm's builds for torch {here[0]}.{here[1]} are {listed} (pip install sgl-deep-gemm=={pick})"


def installed_sgl_version() -> str | None:
    """The installed ``sgl-deep-gemm``'s version where that distribution provides the ``deep_gemm`` that imports
    here, else None (DeepGEMM built from source, or none installed). A source build found first on the path, beside
    an installed ``sgl-deep-gemm``, is the source build: the module's file must be one of the distribution's."""
    spec = importlib.util.find_spec("deep_gemm")
    providers = importlib.metadata.packages_distributions().get("deep_gemm", [])
    if spec is None or not any(name.lower().replace("_", "-") == "sgl-deep-gemm" for name in providers):
        return None
    dist = importlib.metadata.distribution("sgl-deep-gemm")
    if spec.origin and dist.files is not None:  # the files pip recorded (RECORD)
        origin = os.path.realpath(spec.origin)
        if not any(os.path.realpath(dist.locate_file(f)) == origin for f in dist.files):
            return None
    return dist.version


@functools.lru_cache(maxsize=None)
def problem() -> str | None:
    """Why DeepGEMM cannot run under this torch (not installed, or a PyPI build for another torch), or None where
    an installed ``deep_gemm`` may load. Whether it then loads is
    :func:`~jetrl.quant.kernels.gemm_deepgemm.installed`'s to say."""
    if importlib.util.find_spec("deep_gemm") is None:
        return (f"DeepGEMM is not installed (build it from github.com/deepseek-ai/DeepGEMM; "
                f"{builds_for(torch.__version__)}; docs/recipes.md)")
    return build_problem(installed_sgl_version(), torch.__version__)


@functools.lru_cache(maxsize=None)
def auto_problem() -> str | None:
    """Why the default ``gemm="auto"`` leaves DeepGEMM alone, or None where it may use it (a PyPI build for this
    torch, or DeepGEMM built from source; whether it then loads is
    :func:`~jetrl.quant.kernels.gemm_deepgemm.installed`'s to say): not installed, a PyPI build for another torch
    (:func:`problem`), or a release not in :data:`SGL_DEEP_GEMM_TORCH`, whose torch is unknown (on another torch a
    build can abort the process), which only ``gemm="deepgemm"`` uses. An installed DeepGEMM left alone is said once,
    as a warning."""
    if importlib.util.find_spec("deep_gemm") is None:
        return "DeepGEMM is not installed"
    version = installed_sgl_version()
    reason = build_problem(version, torch.__version__)
    if reason is None and version is not None and version not in SGL_DEEP_GEMM_TORCH:
        reason = (f"sgl-deep-gemm {version} is not in jetrl's table of builds, so the torch it runs on is unknown "
                  "(kernels: [gemm=deepgemm] uses it anyway)")
    if reason is not None:
        warnings.warn(f"DeepGEMM is installed, but gemm=auto does not use it: {reason}", RuntimeWarning, stacklevel=2)
    return reason
