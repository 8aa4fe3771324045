"""The packaged assets: the embedded tiny model and its default config, named ``jetrl:NAME``.

They live in the package's ``assets/`` data folder (a data folder, so this module cannot be named
``jetrl.assets``). :func:`resolve_asset` turns ``jetrl:NAME`` into that folder's file or directory
``NAME`` and leaves every other path as it is, so a command or script can take either.
"""

from __future__ import annotations

import os
from pathlib import Path

ASSET_PREFIX = "jetrl:"
EMBEDDED_MODEL = "jetrl:tiny-arith"
DEFAULT_CONFIG = "jetrl:tiny_default.yaml"


def assets_dir() -> Path:
    """The folder of packaged assets (the embedded model and its default config)."""
    return Path(__file__).resolve().parent / "assets"


def resolve_asset(path: str | os.PathLike) -> str:
    """``jetrl:NAME`` -> the packaged asset ``NAME``; any other path is returned unchanged.

    An unknown ``NAME`` is a :class:`ValueError` naming the assets there are."""
    path = os.fspath(path)
    if not path.startswith(ASSET_PREFIX):
        return path
    name = path[len(ASSET_PREFIX):]
    target = assets_dir() / name
    if not target.exists():
        available = sorted(p.name for p in assets_dir().iterdir() if not p.name.startswith(("_", ".")))
        raise ValueError(f"no packaged asset {name!r}; available: {', '.join(available)}")
    return str(target)


__all__ = ["ASSET_PREFIX", "EMBEDDED_MODEL", "DEFAULT_CONFIG", "assets_dir", "resolve_asset"]
