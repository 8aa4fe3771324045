"""Reading run configs (YAML / JSON / TOML files and ``--section.key=value`` overrides) and writing them (YAML).

Sources, later ones winning: the defaults of :mod:`jetrl.config.schema`, a file, then command-line
overrides, each parsed by the type of the field it sets (``--optim.betas=0.9,0.95`` is a tuple of two
floats, ``--optim.grad_clip=none`` is None). An unknown key names the closest valid one. The resolved tree
is then built and validated by the schema. :func:`save_config` writes it next to the run's outputs
(``config.yaml``) so a run can be reproduced from its own folder.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Sequence

import yaml

from jetrl.config.schema import (
    ConfigError, ConfigTypeError, RunConfig, coerce, field_types, from_dict, is_section_type, to_dict,
    unknown_key_error,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser as the tomli package (a dependency there)
    import tomli as tomllib


class _KeySetTwice(Exception):
    """A key set twice in one mapping (``args``: the key and its line from 1, or None). The parsers keep the last
    value, so a second ``optim:`` section would silently replace the first one's settings."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' object hook: the object as a dict, unless a key comes twice."""
    keys = [key for key, _ in pairs]
    twice = next((key for i, key in enumerate(keys) if key in keys[:i]), None)
    if twice is not None:
        raise _KeySetTwice(twice, None)
    return dict(pairs)


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key set twice in one mapping (merge keys aside)."""

    def construct_mapping(self, node, deep=False):
        keys: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in keys:
                    raise _KeySetTwice(key_node.value, key_node.start_mark.line + 1)
                keys.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


def _read_file(path: Path) -> dict[str, Any]:
    """The mapping in a YAML / JSON / TOML file; a syntax error, a key set twice in one mapping or a non-UTF-8
    file is a ConfigError that names the file and the line (counted from 1)."""
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; give a .yaml, .json or .toml file")
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml", ".toml"):
        raise ConfigError(f"config file {path} must end in .yaml, .yml, .json or .toml")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ConfigError(f"config file {path} line {line} is not UTF-8 text (byte {raw[e.start]:#04x}); save it "
                          f"as UTF-8") from None
    try:
        if suffix == ".json":
            data = json.loads(text, object_pairs_hook=_unique_pairs)
        elif suffix == ".toml":
            data = tomllib.loads(text)  # TOML itself forbids a key set twice
        else:
            data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except _KeySetTwice as e:
        key, line = e.args
        where = f" line {line}:" if line is not None else ""
        raise ConfigError(f"config file {path}{where} {key!r} is set twice; keep one of them") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path} line {e.lineno} column {e.colno} is not valid JSON: {e.msg}") from None
    except tomllib.TOMLDecodeError as e:  # the parser's message ends in "(at line L, column C)"
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"config file {path}{where} is not valid YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[list[str], str]:
    """``"--optim.lr=1e-6"`` -> (["optim", "lr"], "1e-6")."""
    body = item[2:] if item.startswith("--") else item
    if "=" not in body:
        raise ConfigError(f"override {item!r} must look like --section.key=value")
    key, value = body.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key")
    return key.split("."), value


def apply_override(data: dict[str, Any], item: str) -> None:
    """Set one ``--a.b=value`` override into the nested mapping ``data`` (a :class:`RunConfig`'s), parsed by the
    field type."""
    path, text = parse_override(item)
    node, node_cls, prefix = data, RunConfig, ""
    for i, part in enumerate(path):
        known = field_types(node_cls)
        if part not in known:
            raise unknown_key_error(part, list(known), prefix)
        key = f"{prefix}.{part}" if prefix else part
        tp = known[part]
        if i == len(path) - 1:
            if is_section_type(tp):
                raise ConfigError(f"override {item!r}: '{key}' is a section; set one of its keys, e.g. "
                                  f"--{key}.{next(iter(field_types(tp)))}=...")
            node[part] = coerce(text, tp, key, from_string=True)
            return
        if not is_section_type(tp):
            raise ConfigError(f"override {item!r}: '{key}' is a value, not a section")
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigTypeError(f"{key} must be a section (a mapping of keys), got {type(child).__name__}")
        node, node_cls, prefix = child, tp, key


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Defaults <- the file at ``path`` (YAML/JSON/TOML, optional) <- ``--a.b=value`` overrides."""
    data = _read_file(Path(path)) if path is not None else {}
    for item in overrides:
        apply_override(data, item)
    return from_dict(RunConfig, data)


def save_config(config: RunConfig, path: str | Path) -> Path:
    """Write ``config`` to ``path``, a .yaml / .yml file (the other formats are read, not written)."""
    path = Path(path)
    if path.suffix.lower() not in (".yaml", ".yml"):
        raise ConfigError(f"config file {path} must end in .yaml or .yml to be written")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
    return path


__all__ = ["load_config", "save_config", "apply_override", "parse_override"]
