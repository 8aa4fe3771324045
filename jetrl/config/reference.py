"""What a configuration means, from the schema itself: the configuration reference and commented YAML.

Every field of :mod:`jetrl.config.schema` is declared with :func:`~jetrl.config.schema.setting`, which keeps its
one-line meaning (and, where the value names an implementation, the registry of valid names) in the field's
metadata; a section's meaning is its class docstring. From those, :func:`reference_markdown` writes
``docs/configuration.md`` and :func:`commented_yaml` writes a config as YAML with each field's meaning beside it
(``jetrl config show``), which loads back to the same config.

The registries' names live in the stages that own them, above this package: the caller passes them in as
:class:`Registry` values (``jetrl.registries.registries()`` gathers them all).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import typing
from typing import Any, Callable, Mapping, NamedTuple

import yaml

from jetrl.config.schema import RunConfig, field_types, is_section_type


class Registry(NamedTuple):
    """The valid names of one kind of implementation, as the reference lists them."""

    title: str                            # e.g. "precision recipes"
    source: str                           # where the names are defined, e.g. "jetrl.quant.recipe.RECIPES"
    names: tuple[str, ...]
    also: str = ""                        # other accepted values, in words (e.g. "or package.module:function")
    check: Callable[[str], Any] | None = None  # raises ValueError for an invalid value; None: membership in names


class FieldDoc(NamedTuple):
    """One field of a section: dotted key, annotation, default, one-line meaning, registry kind (or None)."""

    key: str
    name: str
    type: Any
    default: Any
    doc: str
    registry: str | None


# The longest registry whose names a field's row lists itself; longer ones are listed under "Registries" only.
INLINE_NAMES = 8
REGENERATE = "python -m jetrl config reference > docs/configuration.md"


def sections(cls: type = RunConfig, prefix: str = "") -> list[tuple[str, type]]:
    """``[("", RunConfig), ("model", ModelConfig), ...]``: every section of the tree, depth first, in order."""
    found = [(prefix, cls)]
    for name, tp in field_types(cls).items():
        if is_section_type(tp):
            found += sections(tp, f"{prefix}.{name}" if prefix else name)
    return found


def section_of(config: Any, prefix: str) -> Any:
    """The section of ``config`` at the dotted ``prefix`` (``""``: ``config`` itself)."""
    for part in prefix.split(".") if prefix else []:
        config = getattr(config, part)
    return config


def field_docs(cls: type, prefix: str = "") -> list[FieldDoc]:
    """The value fields of the section ``cls`` (not its sub-sections) with their meanings; a ValueError names a
    field declared without one (use :func:`~jetrl.config.schema.setting`)."""
    types = field_types(cls)
    docs = []
    for f in dataclasses.fields(cls):
        if not f.init or is_section_type(types[f.name]):
            continue
        key = f"{prefix}.{f.name}" if prefix else f.name
        doc = f.metadata.get("doc", "")
        if not doc or "\n" in doc:
            raise ValueError(f"config field {key} has no one-line meaning: declare it with setting(default, doc)")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        docs.append(FieldDoc(key, f.name, types[f.name], default, doc, f.metadata.get("registry")))
    return docs


def section_doc(cls: type) -> str:
    """The section's meaning: its class docstring, one line per paragraph, literals in Markdown's backticks."""
    text = re.sub(r"``(.+?)``", r"`\1`", (cls.__doc__ or "").strip())  # RST literals as Markdown code
    return "\n\n".join(" ".join(line.strip() for line in block.splitlines()) for block in text.split("\n\n"))


def registry_kinds(cls: type = RunConfig) -> dict[str, list[str]]:
    """Every registry kind a field of the tree names, in field order -> the dotted keys of those fields."""
    kinds: dict[str, list[str]] = {}
    for prefix, section in sections(cls):
        for d in field_docs(section, prefix):
            if d.registry:
                kinds.setdefault(d.registry, []).append(d.key)
    return kinds


def type_text(tp: Any) -> str:
    """An annotation as a reader writes the value: ``int``, ``str or null``, ``list of int``, ``[float, float]``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if args and type(None) in args:
        return f"{type_text(next(a for a in args if a is not type(None)))} or null"
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return f"list of {type_text(args[0])}"
        return "[" + ", ".join(type_text(a) for a in args) + "]"
    return tp.__name__


def yaml_value(value: Any) -> str:
    """``value`` as one line of YAML that reads back as the same value (a float as a float, a string with a
    newline or a ``#`` quoted, a tuple as a flow list)."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(yaml_value(v) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"a config value must be finite, got {value}")
    text = yaml.safe_dump(value, default_flow_style=True, width=math.inf).rstrip("\n").removesuffix("\n...")
    if "\n" in text or yaml.safe_load(text) != value:
        text = json.dumps(value)  # a JSON string is a YAML double-quoted scalar
    return text


def commented_yaml(config: RunConfig, title: str = "") -> str:
    """``config`` as YAML, every field with its meaning as a comment and every section under its own; loading
    the text (:func:`jetrl.config.load_config`) gives ``config`` back. ``title`` heads it as a comment."""
    lines = [f"# {line}".rstrip() for line in title.splitlines()]
    for prefix, cls in sections(type(config)):
        node, depth = section_of(config, prefix), prefix.count(".") + 1 if prefix else 0
        indent = "  " * depth
        if prefix:
            lines += ["", f"{'  ' * (depth - 1)}# {section_doc(cls).splitlines()[0]}",
                      f"{'  ' * (depth - 1)}{prefix.rsplit('.', 1)[-1]}:"]
        rows = [(f"{indent}{d.name}: {yaml_value(getattr(node, d.name))}", d.doc) for d in field_docs(cls, prefix)]
        width = max((len(text) for text, _ in rows), default=0)
        lines += [f"{text:<{width}}  # {doc}" for text, doc in rows]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """Text for a Markdown table cell: pipes escaped."""
    return text.replace("|", "\\|")


def reference_markdown(registries: Mapping[str, Registry]) -> str:
    """The configuration reference (``docs/configuration.md``): every section and field of the schema with its
    type, default and meaning, then the valid names of every registry. ``registries`` maps each kind that a
    field names (:func:`registry_kinds`) to its names; a kind missing there is a KeyError."""
    used = registry_kinds()
    missing = [kind for kind in used if kind not in registries]
    if missing:
        raise KeyError(f"no registry given for {missing}")
    all_sections = sections()
    toc = ", ".join(f"[{'`' + p + '`' if p else 'top level'}](#{p.replace('.', '') or 'top-level'})"
                    for p, _ in all_sections)
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated from jetrl/config/schema.py: edit the schema, then run `{REGENERATE}`. -->",
        "",
        "A run is one YAML, JSON or TOML file of the sections below. Every field has a default, so a file sets only "
        "what it changes; `--section.field=value` after the file overrides one field (`--optim.betas=0.9,0.95` for a "
        "list, `--optim.grad_clip=null` for null). `jetrl config show [CONFIG] [--section.field=value ...]` prints "
        "the resolved configuration with each field's meaning (the embedded default without a file); `jetrl config "
        "check CONFIG [...]` validates it without loading a model. A wrong key, type or value is one `jetrl: error:` "
        "line, before any model is loaded.",
        "",
        "Batch sizes are counted in sequences (a prompt and one completion): the rollout batch of a step is "
        "`data.prompts_per_step * rollout.n` sequences; it must divide into mini-batches of "
        "`algorithm.mini_batch_size` (one optimizer step each, per PPO epoch), and a mini-batch into micro-batches "
        "of `algorithm.micro_batch_size` (gradient accumulation) unless `algorithm.max_tokens_per_micro_batch` packs "
        "them by token count. Under `torchrun`, `data.prompts_per_step` and the mini-batch must divide by the number "
        "of ranks.",
        "",
        f"Sections: {toc}; then the [registries](#registries) of valid names.",
    ]
    for prefix, cls in all_sections:
        out += ["", f"## {'`' + prefix + '`' if prefix else 'Top level'}", "", section_doc(cls), "",
                "| field | type | default | meaning |", "| --- | --- | --- | --- |"]
        for d in field_docs(cls, prefix):
            meaning = d.doc
            if d.registry:
                reg = registries[d.registry]
                if len(reg.names) <= INLINE_NAMES:
                    names = ", ".join(f"`{n}`" for n in reg.names)
                    meaning += f"; one of {names}" + (f", {reg.also}" if reg.also else "")
                else:
                    meaning += f"; see [{reg.title}](#registries)"
            out.append(f"| `{d.key}` | {type_text(d.type)} | `{yaml_value(d.default)}` | {_cell(meaning)} |")
    out += ["", "## Registries", "",
            "The names a field accepts, read from the registry that defines them (a name added there is valid in "
            "a config at once).", "", "| registry | fields | defined in | names |", "| --- | --- | --- | --- |"]
    for kind, keys in used.items():
        reg = registries[kind]
        names = ", ".join(f"`{n}`" for n in reg.names) + (f"; {reg.also}" if reg.also else "")
        out.append(f"| {reg.title} | {', '.join(f'`{k}`' for k in keys)} | `{reg.source}` | {_cell(names)} |")
    return "\n".join(out) + "\n"


__all__ = ["Registry", "FieldDoc", "REGENERATE", "sections", "section_of", "field_docs", "section_doc",
           "registry_kinds", "type_text", "yaml_value", "commented_yaml", "reference_markdown"]
