"""Every registry of names that a config field can take, gathered above the stages that own them.

The recipes, advantage and KL estimators, loss aggregations and LR schedules, dataset formats, built-in tasks and
rewards, parameter dtypes and kernel settings each live with the code they name. :func:`registries` reads them all,
so the configuration reference (:func:`configuration_reference`, ``docs/configuration.md``) lists the names that
are valid now, and :func:`check_config` checks a config against them before anything is loaded (``jetrl config
check``).
"""

from __future__ import annotations

import itertools

from jetrl.config import DTYPES, ConfigError, RunConfig
from jetrl.config.reference import Registry, field_docs, reference_markdown, section_of, sections
from jetrl.config.schema import check_choice


def registries() -> dict[str, Registry]:
    """Registry kind (the ``registry`` of a :func:`~jetrl.config.schema.setting`) -> its names, read from the
    registries themselves."""
    from jetrl.data import BUILTIN_REWARDS, DATASET_FORMATS, TASKS, resolve_reward
    from jetrl.data.tasks import STYLES
    from jetrl.quant.kernels.tuning import settable_fields
    from jetrl.quant.recipe import RECIPES
    from jetrl.rl.advantages import ADVANTAGE_ESTIMATORS
    from jetrl.rl.losses import AGGREGATIONS, KL_ESTIMATORS
    from jetrl.train.optim import LR_SCHEDULES

    return {
        "recipe": Registry("precision recipes", "jetrl.quant.recipe.RECIPES", tuple(RECIPES)),
        "dtype": Registry("parameter dtypes", "jetrl.config.schema.DTYPES", tuple(DTYPES)),
        "dataset_format": Registry("dataset formats", "jetrl.data.datasets.DATASET_FORMATS", tuple(DATASET_FORMATS)),
        "task": Registry("built-in tasks", "jetrl.data.tasks.TASKS", tuple(TASKS)),
        "task_style": Registry("task prompt styles", "jetrl.data.tasks.STYLES", tuple(STYLES)),
        "reward": Registry("reward functions", "jetrl.data.rewards.BUILTIN_REWARDS", tuple(BUILTIN_REWARDS),
                           also="or `package.module:function`", check=resolve_reward),
        "advantage_estimator": Registry("advantage estimators", "jetrl.rl.advantages.ADVANTAGE_ESTIMATORS",
                                        tuple(ADVANTAGE_ESTIMATORS)),
        "loss_aggregation": Registry("loss aggregations", "jetrl.rl.losses.AGGREGATIONS", tuple(AGGREGATIONS)),
        "kl_estimator": Registry("KL estimators", "jetrl.rl.losses.KL_ESTIMATORS", tuple(KL_ESTIMATORS)),
        "lr_schedule": Registry("learning-rate schedules", "jetrl.train.optim.LR_SCHEDULES", tuple(LR_SCHEDULES)),
        "kernel_setting": Registry("kernel settings", "jetrl.quant.kernels.tuning.KernelTuning",
                                   settable_fields(), also="each as `KEY=VALUE`; their meanings under "
                                                           "[Kernel settings](#kernel-settings)"),
    }


def check_config(config: RunConfig) -> None:
    """Everything that can be checked from a loaded config alone, without a model or data (``jetrl config
    check``): that it is complete (:meth:`~jetrl.config.RunConfig.check_complete`) and :func:`check_names`."""
    config.check_complete()
    check_names(config)


def check_names(config: RunConfig) -> None:
    """A ConfigError naming the field whose value is not a name its registry holds (or that the registry's own
    check rejects): those the schema leaves to the stage that uses them (dataset format, task, reward) as well as
    those it checks itself. A list field (``kernels``) is checked by the schema, entry by entry."""
    found = registries()
    for prefix, cls in sections(type(config)):
        node = section_of(config, prefix)
        for d in field_docs(cls, prefix):
            value = getattr(node, d.name)
            if d.registry is None or not isinstance(value, str):
                continue
            reg = found[d.registry]
            if reg.check is not None:
                try:
                    reg.check(value)
                except ValueError as exc:
                    raise ConfigError(f"{d.key}: {exc}") from None
            else:
                check_choice(d.key, value, reg.names)


def configuration_reference() -> str:
    """The text of ``docs/configuration.md``: every field of the schema, the names of every registry, and every
    kernel setting with its default, what it accepts and its meaning."""
    from jetrl.quant.kernels.tuning import setting_docs

    out = ["", "## Kernel settings", "",
           "`kernels: [KEY=VALUE, ...]` sets these for the whole run (the benchmarks' `--tuning` and arms take the "
           "same). None changes a result's bits except the GEMM path (with the routing bounds and the decode GEMM's "
           "configs, whose K split is a summation order), exact mode's K split (`exact_split_k`) and the FP8-cache "
           "decode attention's kernel, tiles and splits (summation order); the rest are schedules. "
           "What each does in depth: `jetrl.quant.kernels.tuning.KernelTuning`'s family docstrings.", ""]
    for family, rows in itertools.groupby(setting_docs(), key=lambda row: row[0]):
        out += ["", f"### {family[0].upper() + family[1:]}", "", "| setting | default | accepts | meaning |",
                "| --- | --- | --- | --- |"]
        out += [f"| `{name}` | `{default}` | {rule} | {meaning} |" for _, name, default, rule, meaning in rows]
    return reference_markdown(registries()) + "\n".join(out).replace("\n\n\n", "\n\n") + "\n"


__all__ = ["registries", "check_config", "check_names", "configuration_reference"]
