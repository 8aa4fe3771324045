"""The packaged assets: the embedded tiny model and its default config, named ``jetrl:NAME``.

They live in the package's ``assets/`` data folder (a data folder, so this module cannot be named
``jetrl.assets``). :func:`resolve_asset` turns ``jetrl:NAME`` into that folder's file or directory
``NAME`` and leaves every other path as it is, so a command or script can take either; :func:`existing_path`,
:func:`config_path` and :func:`model_path` resolve the paths a command takes and check them before any work.
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


def existing_path(path: str, what: str, hint: str) -> str:
    """``path`` resolved (:func:`resolve_asset`), which must exist: else a :class:`FileNotFoundError` naming ``what``
    it is, with ``hint``."""
    path = resolve_asset(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{what} {path} does not exist; {hint}")
    return path


def config_path(path: str | None) -> str:
    """The config file a command reads (default: the embedded one), which must exist."""
    return existing_path(path or DEFAULT_CONFIG, "config file", "give a YAML/JSON/TOML config, e.g. "
                         "examples/tiny_default.yaml")


def model_path(path: str) -> str:
    """A checkpoint folder, a .gguf file, ``jetrl:tiny-arith``, or a hub-style ``owner/name`` (resolved by the
    loader)."""
    path = resolve_asset(path)
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        return path
    if not os.path.isdir(path) and (path.startswith((".", "/", "~")) or path.count("/") != 1):
        raise FileNotFoundError(f"checkpoint folder {path} does not exist; give a HuggingFace model folder (holding "
                                f"config.json and *.safetensors), a .gguf file or {EMBEDDED_MODEL}")
    return path


__all__ = ["ASSET_PREFIX", "EMBEDDED_MODEL", "DEFAULT_CONFIG", "assets_dir", "resolve_asset", "existing_path",
           "config_path", "model_path"]
