"""Every kernel setting declares its family, a one-line meaning and what it accepts; the object checks each field by
that declaration, and the configuration reference prints all of it."""

import dataclasses

import pytest

from jetrl.quant.kernels import tuning
from jetrl.registries import configuration_reference

# a value each kind of rule rejects, by the text that rule prints
BAD = {"a bool": 1, "a non-negative int": -1, "a positive int": 0, "a power of two": 6,
       "a positive finite number": float("inf")}


def test_every_settable_field_is_declared_and_documented():
    docs = tuning.setting_docs()
    names = [d[1] for d in docs]
    assert sorted(names) == sorted(tuning.settable_fields()) and len(names) == len(set(names))
    families = [d[0] for d in docs]
    assert set(families) == set(tuning.FAMILIES)
    assert families == sorted(families, key=tuning.FAMILIES.index)  # grouped, in the reference's order
    for family, name, default, rule, meaning in docs:
        assert meaning and "\n" not in meaning and len(meaning) <= 160, name
        assert rule and default != "", name
    text = configuration_reference()
    assert "## Kernel settings" in text
    for family, name, default, rule, meaning in docs:
        assert f"| `{name}` | `{default}` | {rule} | {meaning} |" in text


def test_each_field_is_checked_by_its_declared_rule():
    checked = 0
    for f in dataclasses.fields(tuning.KernelTuning):
        rule = f.metadata.get("rule")
        if rule is None:
            continue
        assert rule.accepts(f.default), f.name  # the defaults pass their own rules
        bad = next((v for text, v in BAD.items() if rule.text.startswith(text) and not rule.accepts(v)), None)
        if bad is None:  # ranged rules: past their upper end
            bad = next(v for v in (1 << 20, 300, 999, True) if not rule.accepts(v))
        with pytest.raises(ValueError, match=f"KernelTuning.{f.name} must be "):
            tuning.KernelTuning(**{f.name: bad})
        checked += 1
    assert checked == len(tuning.settable_fields()) - 1  # all but gemm, which has its own message
    with pytest.raises(ValueError, match="must be one of"):
        tuning.KernelTuning(gemm="fastest")
    with pytest.raises(ValueError, match="kernels: KernelTuning.kv_decode_stream_warps must be a power of two in 1..8"):
        tuning.parse_settings(["kv_decode_stream_warps=3"])


def test_the_settings_are_four_frozen_families():
    """KernelTuning is its four family dataclasses and nothing else: every field is declared by exactly one family,
    in the reference's order, and each family is frozen like the whole."""
    names = [f.name for cls in tuning.FAMILY_CLASSES for f in dataclasses.fields(cls)]
    assert names == [f.name for f in dataclasses.fields(tuning.KernelTuning)] and len(names) == len(set(names))
    assert len(names) <= 35
    for cls, title in zip(tuning.FAMILY_CLASSES, tuning.FAMILIES):
        assert cls.__dataclass_params__.frozen and issubclass(tuning.KernelTuning, cls)
        assert {tuning.family_of(f.name) for f in dataclasses.fields(cls)} == {title}
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuning.current().gluon = False
    with pytest.raises(KeyError):
        tuning.family_of("not_a_setting")
