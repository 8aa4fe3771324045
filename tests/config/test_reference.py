"""The configuration reference (docs/configuration.md) and commented YAML, both read from the schema's fields."""

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pytest

from jetrl.config import ConfigError, RunConfig, load_config, to_dict
from jetrl.config.reference import (
    REGENERATE, Registry, commented_yaml, field_docs, reference_markdown, registry_kinds, section_of, sections,
    type_text, yaml_value,
)
from jetrl.config.schema import setting
from jetrl.registries import check_names, configuration_reference, registries

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "configuration.md"


def _all_fields():
    return [d for prefix, cls in sections() for d in field_docs(cls, prefix)]


def test_docs_configuration_md_is_up_to_date_with_the_schema():
    assert REFERENCE.is_file(), f"docs/configuration.md is missing; generate it: {REGENERATE}"
    assert REFERENCE.read_text() == configuration_reference(), (
        f"docs/configuration.md is out of date with jetrl/config/schema.py or a registry; regenerate it from the "
        f"repository root: PYTHONPATH=. {REGENERATE}")


def test_every_field_has_a_one_line_meaning_and_appears_in_the_reference():
    text = configuration_reference()
    fields = _all_fields()
    assert len(fields) > 50 and len({d.key for d in fields}) == len(fields)
    for d in fields:
        assert d.doc and "\n" not in d.doc
        assert f"| `{d.key}` | {type_text(d.type)} | `{yaml_value(d.default)}` |" in text, d.key
    for prefix, _ in sections()[1:]:
        assert f"## `{prefix}`" in text


def test_every_registry_a_field_names_exists_and_all_its_names_are_listed():
    found = registries()
    assert set(registry_kinds()) == set(found), "a registry kind that no field names, or a field naming none"
    text = configuration_reference()
    registries_part = text[text.index("## Registries"):]
    for kind, reg in found.items():
        assert reg.names, kind
        for name in reg.names:
            assert f"`{name}`" in registries_part, (kind, name)
    # the names come from the registries themselves
    from jetrl.data import TASKS
    from jetrl.quant.recipe import RECIPES
    assert found["task"].names == tuple(TASKS) and found["recipe"].names == tuple(RECIPES)
    assert "exact_split_k" in found["kernel_setting"].names
    assert "decode_max_m_by_shape" not in found["kernel_setting"].names  # a mapping: no KEY=VALUE can set it


def test_a_field_without_a_meaning_is_an_error():
    @dataclass
    class Bare:
        documented: int = setting(1, "a count")
        bare: int = 2

    with pytest.raises(ValueError, match="Bare|bare.*setting"):
        field_docs(Bare)


def test_a_missing_registry_is_an_error():
    found = registries()
    del found["task"]
    with pytest.raises(KeyError, match="task"):
        reference_markdown(found)


def test_short_registries_are_listed_in_the_field_row_and_long_ones_linked():
    found = registries()
    found["task"] = Registry("built-in tasks", "here", ("alpha", "beta"))
    text = reference_markdown(found)
    row = next(line for line in text.splitlines() if line.startswith("| `data.task` |"))
    assert "one of `alpha`, `beta`" in row
    found["task"] = Registry("built-in tasks", "here", tuple(f"t{i}" for i in range(20)))
    row = next(line for line in reference_markdown(found).splitlines() if line.startswith("| `data.task` |"))
    assert "t19" not in row and "(#registries)" in row


@pytest.mark.parametrize("tp, text", [(int, "int"), (str | None, "str or null"), (tuple[int, ...], "list of int"),
                                      (tuple[float, float], "[float, float]"), (float | None, "float or null")])
def test_type_text(tp, text):
    assert type_text(tp) == text


@pytest.mark.parametrize("value", [None, True, 0, -1, 1e-6, 3.0e-5, 600.0, "", "jet", "yes", "null", "1e-6",
                                   "a # not a comment", "two\nlines", "{prompt}: 'quoted' \"too\"", "jetrl:tiny-arith",
                                   (0.9, 0.95), (), ("exact_split_k=1",)])
def test_yaml_value_reads_back_as_the_same_value(value):
    import yaml

    text = yaml_value(value)
    assert "\n" not in text
    read = yaml.safe_load(f"key: {text}  # a comment")["key"]
    assert (tuple(read) if isinstance(value, tuple) else read) == value


def _tricky_config(tmp_path):
    overrides = ["--data.system_prompt=You are # careful.\nAnswer briefly.", "--data.instruction=Q: {prompt} 'now'",
                 "--optim.betas=0.9,0.95", "--optim.lr=2.5e-7", "--optim.grad_clip=none", "--algorithm.tis_cap=2",
                 "--rollout.stop_token_ids=[3, 7]", "--kernels=exact_split_k=1,kv_decode_block_n=64",
                 "--trainer.output_dir=runs/a b: c", "--model.tokenizer=yes", "--distributed.shard_size=8"]
    return load_config(REPO / "examples" / "gsm8k_qwen2.5_jet.yaml", overrides)


@pytest.mark.parametrize("which", ["default", "embedded", "tricky"])
def test_commented_yaml_loads_back_to_the_same_config(tmp_path, which):
    config = {"default": RunConfig(), "embedded": load_config(REPO / "jetrl" / "assets" / "tiny_default.yaml"),
              "tricky": _tricky_config(tmp_path)}[which]
    path = tmp_path / "shown.yaml"
    path.write_text(commented_yaml(config, title="a title\nover two lines"))
    assert load_config(path) == config
    assert to_dict(load_config(path)) == to_dict(config)


def test_commented_yaml_lists_every_field_with_its_meaning():
    text = commented_yaml(RunConfig(), title="head")
    assert text.startswith("# head\n")
    lines = iter(text.splitlines())
    for prefix, cls in sections():
        node = section_of(RunConfig(), prefix)
        indent = "  " * (prefix.count(".") + 1 if prefix else 0)
        for d in field_docs(cls, prefix):  # in order: each field's line comes after the previous one's
            line = next((x for x in lines if x.startswith(f"{indent}{d.name}: ")), None)
            assert line is not None, d.key
            assert line.endswith(f"  # {d.doc}") and f": {yaml_value(getattr(node, d.name))} " in line, line


def test_check_names_catches_names_the_schema_leaves_to_the_data_stage():
    config = RunConfig()
    check_names(config)
    bad_task = dataclasses.replace(config, data=dataclasses.replace(config.data, task="arithmetc"))
    with pytest.raises(ConfigError, match=r"data.task must be one of .*did you mean 'arithmetic'"):
        check_names(bad_task)
    bad_format = dataclasses.replace(config, data=dataclasses.replace(config.data, format="gsm9k"))
    with pytest.raises(ConfigError, match="data.format"):
        check_names(bad_format)
    bad_reward = dataclasses.replace(config, data=dataclasses.replace(config.data, reward="nope"))
    with pytest.raises(ConfigError, match="data.reward: reward 'nope'"):
        check_names(bad_reward)
    dotted = dataclasses.replace(config, data=dataclasses.replace(config.data, reward="jetrl.data.rewards:math_reward"))
    check_names(dotted)
