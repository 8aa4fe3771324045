"""The benchmark scripts of the source checkout's ``bench/`` folder, found and run by name (``jetrl bench``).

The scripts are not part of the installed package: :func:`available_benches` lists those beside it in a source
checkout (none in a plain install) and :func:`run_bench` runs one's ``main`` with its arguments. ``fp8`` heads the
list: the FP8 self-check (:func:`jetrl.quant.selfcheck.check_fp8_linear`, ``jetrl check-fp8``), which is no script.
A leaf module: it imports nothing of jetrl.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def bench_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "bench"


def available_benches() -> list[str]:
    scripts = bench_dir().glob("*.py")  # none without a bench/ folder (a plain install)
    return ["fp8"] + sorted(p.stem for p in scripts if not p.stem.startswith("_") and p.stem != "common")


def run_bench(name: str, argv: list[str]) -> None:
    """Run the script ``bench/NAME.py`` (a name of :func:`available_benches`, never a path): its ``main(argv)``,
    with the bench folder on ``sys.path`` meanwhile (the scripts import their ``common``). The module is registered
    in ``sys.modules`` while it runs, as an imported one is: dataclasses with string annotations look it up there."""
    path = bench_dir() / f"{name}.py"
    module_name = f"jetrl_bench_{name}"
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
        module.main(list(argv))
    finally:
        sys.modules.pop(module_name, None)
        sys.path.remove(str(path.parent))


__all__ = ["bench_dir", "available_benches", "run_bench"]
