"""Run config: typed loading from files and overrides, clear errors before anything is loaded."""

import json
import subprocess
import sys

import pytest

from jetrl.config import (
    AlgorithmConfig, ConfigError, ConfigTypeError, RunConfig, from_dict, load_config, save_config, to_dict,
)


def write(tmp_path, data, name="run.json"):
    p = tmp_path / name
    p.write_text(json.dumps(data))
    return p


def test_defaults_are_valid():
    c = RunConfig()
    assert c.recipe == "jet" and c.rollout_batch_size == 64


def test_checkpoint_blocks_needs_checkpointing_and_a_count():
    c = load_config(None, ["--model.gradient_checkpointing=true", "--model.checkpoint_blocks=3"])
    assert c.model.checkpoint_blocks == 3 and RunConfig().model.checkpoint_blocks is None
    with pytest.raises(ConfigError, match="model.checkpoint_blocks applies with model.gradient_checkpointing: true"):
        load_config(None, ["--model.checkpoint_blocks=3"])
    with pytest.raises(ConfigError, match="model.checkpoint_blocks must be >= 0"):
        load_config(None, ["--model.gradient_checkpointing=true", "--model.checkpoint_blocks=-1"])


def test_file_then_overrides(tmp_path):
    p = write(tmp_path, {"recipe": "fp8-rollout", "optim": {"lr": 3e-6}, "rollout": {"n": 4}})
    c = load_config(p, ["--optim.lr=1e-5", "--optim.betas=0.9,0.95", "--algorithm.tis_cap=2",
                        "--trainer.tensorboard=true", "--rollout.stop_token_ids=[3, 7]", "data.task=countdown",
                        "--algorithm.mini_batch_size=32", "--optim.grad_clip=none"])
    assert c.recipe == "fp8-rollout" and c.rollout.n == 4
    assert c.optim.lr == 1e-5 and c.optim.betas == (0.9, 0.95)
    assert c.algorithm.tis_cap == 2.0 and isinstance(c.algorithm.tis_cap, float)
    assert c.trainer.tensorboard is True and c.rollout.stop_token_ids == (3, 7)
    assert c.data.task == "countdown" and c.optim.grad_clip is None


@pytest.mark.parametrize("source, message", [
    ({"optim": {"lrr": 1e-6}}, "unknown config key 'optim.lrr'; did you mean 'optim.lr'"),
    ({"optimizer": {"lr": 1e-6}}, "unknown config key 'optimizer'; did you mean 'optim'"),
    ("--rollout.temprature=0.5", "unknown config key 'rollout.temprature'; did you mean 'rollout.temperature'"),
    ("--algorithm.clip_hi=0.3", "did you mean 'algorithm.clip_high'"),
])
def test_unknown_keys_name_the_closest(tmp_path, source, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        if isinstance(source, dict):
            load_config(write(tmp_path, source))
        else:
            load_config(None, [source])


@pytest.mark.parametrize("data, message", [
    ({"rollout": {"n": "eight"}}, "rollout.n must be an int, got str"),
    ({"rollout": {"n": True}}, "rollout.n must be an int, got bool"),
    ({"rollout": {"n": 2.5}}, "rollout.n must be an int, got float"),
    ({"optim": {"lr": "fast"}}, "optim.lr must be a number, got str"),
    ({"trainer": {"tensorboard": "maybe"}}, "trainer.tensorboard must be a bool"),
    ({"optim": {"betas": [0.9]}}, "optim.betas must have 2 elements"),
    ({"optim": 3}, "optim must be a section"),
    ({"recipe": 1}, "recipe must be a string"),
])
def test_wrong_types(tmp_path, data, message):
    with pytest.raises(ConfigTypeError, match=message):
        load_config(write(tmp_path, data))
    with pytest.raises(TypeError):  # ConfigTypeError is a TypeError too
        load_config(write(tmp_path, data))


@pytest.mark.parametrize("overrides, message", [
    (["--algorithm.clip_low=-0.1"], r"algorithm.clip_low must be >= 0.0, got -0.1"),
    (["--algorithm.clip_high=-1"], r"algorithm.clip_high must be >= 0.0"),
    (["--rollout.n=0"], r"rollout.n must be >= 1, got 0"),
    (["--recipe=jett"], r"recipe must be one of \['bf16', 'fp8-rollout', 'jet'\], got 'jett' \(did you mean 'jet'\?\)"),
    (["--algorithm.agg=tokens"], r"algorithm.agg must be one of"),
    (["--data.prompts_per_step=3", "--rollout.n=4", "--algorithm.mini_batch_size=8"],
     r"rollout batch .* = 12 sequences\) must be divisible by algorithm.mini_batch_size \(8\)"),
    (["--algorithm.mini_batch_size=32", "--algorithm.micro_batch_size=5"],
     r"the mini-batch \(32 sequences\) must be divisible by algorithm.micro_batch_size \(5\)"),
    (["--algorithm.max_tokens_per_micro_batch=100"], r"must hold the longest sequence .* = 1024"),
    (["--algorithm.tis_cap=0.5"], r"algorithm.tis_cap must be >= 1.0"),
    (["--optim.schedule=cosinus"], r"did you mean 'cosine'"),
    (["--rollout.top_p=0"], r"rollout.top_p must be in \(0, 1\]"),
    (["--rollout.stop_token_ids=[2, -1]"], r"rollout.stop_token_ids must be token ids >= 0, got \[2, -1\]"),
    (["--optim.lr=nan"], r"optim.lr must be finite"),
    (["--data.path=a.jsonl", "--data.task=countdown"], r"are exclusive"),
    (["--optim=3"], r"'optim' is a section"),
    (["--optim.lr"], r"must look like --section.key=value"),
])
def test_invalid_values(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_direct_construction_is_checked_too():
    with pytest.raises(ConfigTypeError, match="algorithm.clip_low must be a number"):
        AlgorithmConfig(clip_low="wide")
    with pytest.raises(ConfigError, match="algorithm.ppo_epochs must be >= 1"):
        AlgorithmConfig(ppo_epochs=0)
    assert from_dict(RunConfig, {}) == RunConfig()


ROUND_TRIP = ["--recipe=bf16", "--optim.betas=0.8,0.9", "--optim.grad_clip=null", "--algorithm.tis_cap=2.5",
              '--data.instruction="{prompt}" \\ say "hi"', "--data.path=/tmp/x.jsonl", "--rollout.stop_token_ids=1,2",
              "--optim.lr=2e-7"]


def test_round_trip(tmp_path):
    c = load_config(None, ROUND_TRIP)
    p = save_config(c, tmp_path / "run.yaml")
    assert load_config(p) == c
    assert load_config(save_config(RunConfig(), tmp_path / "default.yml")) == RunConfig()
    with pytest.raises(ConfigError, match=r"must end in \.yaml or \.yml to be written"):
        save_config(c, tmp_path / "run.json")


def test_json_and_toml_files(tmp_path):
    c = load_config(None, ROUND_TRIP)
    p = tmp_path / "run.json"
    p.write_text(json.dumps(to_dict(c), indent=2))
    assert load_config(p) == c
    p = tmp_path / "run.toml"  # TOML has no null: the string "none" reads as None
    p.write_text('recipe = "bf16"\n[optim]\nbetas = [0.8, 0.9]\ngrad_clip = "none"\nlr = 2e-7\n'
                 '[algorithm]\ntis_cap = 2.5\n[data]\ninstruction = "\\"{prompt}\\" \\\\ say \\"hi\\""\n'
                 'path = "/tmp/x.jsonl"\n[rollout]\nstop_token_ids = [1, 2]\n')
    assert load_config(p) == c


def test_yaml_float_strings(tmp_path):
    yaml = pytest.importorskip("yaml")
    p = tmp_path / "run.yaml"
    p.write_text("optim:\n  lr: 1e-6\nrollout:\n  n: 4\n")  # YAML 1.1 reads 1e-6 as a string
    assert isinstance(yaml.safe_load(p.read_text())["optim"]["lr"], str)
    assert load_config(p).optim.lr == 1e-6


def test_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    p = tmp_path / "run.ini"
    p.write_text("x=1")
    with pytest.raises(ConfigError, match="must end in .yaml"):
        load_config(p)
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(write(tmp_path, [1, 2]))


def test_config_errors_need_no_torch():
    """Config problems surface before anything heavy is imported (no torch, no model)."""
    code = ("import sys, jetrl.config as c\n"
            "try:\n    c.load_config(None, ['--rollout.n=0'])\nexcept c.ConfigError: pass\n"
            "assert 'torch' not in sys.modules, 'config imported torch'\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_valid_config_reads_the_registries_without_the_trainer():
    """Checking choice fields imports the registries (recipes, estimators, schedules) in a fresh interpreter,
    without an import loop and without the trainer, model or rollout stack."""
    code = ("import sys, jetrl.config as c\n"
            "c.load_config(None, ['--recipe=bf16'])\n"
            "heavy = [m for m in ('jetrl.rl.trainer', 'jetrl.rl.loop', 'jetrl.models', 'jetrl.rollout') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_choice_fields_follow_the_registries_that_own_them():
    """One list per choice: the config accepts what the registry holds, in its order, and nothing else; a
    registry whose names differ from the config's list is refused when it is built."""
    from jetrl.config import registered_names
    from jetrl.config.choices import choice_registry
    from jetrl.quant.recipe import RECIPES
    from jetrl.rl import advantages, losses
    from jetrl.train import optim

    registries = {"recipe": RECIPES, "advantage_estimator": advantages.ADVANTAGE_ESTIMATORS,
                  "kl_estimator": losses.KL_ESTIMATORS, "loss_aggregation": losses.AGGREGATIONS,
                  "lr_schedule": optim.LR_SCHEDULES}
    for kind, registry in registries.items():
        assert registered_names(kind) == list(registry)
    with pytest.raises(ValueError, match="no registry"):
        registered_names("optimizer")
    with pytest.raises(ConfigError, match="algorithm.kl_estimator must be one of"):
        load_config(None, ["--algorithm.kl_estimator=k4"])
    with pytest.raises(ValueError, match=r"kl_estimator registry names \['k1', 'k2', 'k3', 'k4'\]"):
        choice_registry("kl_estimator", {**losses.KL_ESTIMATORS, "k4": losses.KL_ESTIMATORS["k3"]})
    with pytest.raises(ValueError, match="no choice list"):
        choice_registry("optimizer", {})


# ------------------------------------------------------------------------------------------ reliability

def test_malformed_files_name_the_file_and_line(tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("trainer:\n  steps: 3\n  seed: [1, 2\n")
    with pytest.raises(ConfigError, match=r"^config file .*bad.yaml line \d+ column \d+ is not valid YAML: "):
        load_config(bad_yaml)
    tabs = tmp_path / "tabs.yaml"
    tabs.write_text("trainer:\n\tsteps: 3\n")
    with pytest.raises(ConfigError, match=r"tabs.yaml line 2 column 1 is not valid YAML"):
        load_config(tabs)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{\n  "trainer": {"steps": 3,}\n}')
    with pytest.raises(ConfigError, match=r"^config file .*bad.json line 2 column 26 is not valid JSON: "):
        load_config(bad_json)
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[trainer]\nsteps = = 3\n")
    with pytest.raises(ConfigError, match=r"^config file .*bad.toml is not valid TOML: .*\(at line 2, column 9\)"):
        load_config(bad_toml)
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes("# config\ndata:\n  system_prompt: caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"^config file .*latin1.yaml line 3 is not UTF-8 text \(byte 0xe9\)"):
        load_config(latin1)
    (tmp_path / "folder.yaml").mkdir()
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path / "folder.yaml")


def test_reward_section_and_allow_pickle():
    config = RunConfig()
    assert config.reward.max_abs is None and config.reward.stop_fraction == 1.0
    assert config.trainer.allow_pickle is False
    config = load_config(None, ["--reward.max_abs=10", "--reward.stop_fraction=0.5", "--trainer.allow_pickle=true"])
    assert (config.reward.max_abs, config.reward.stop_fraction, config.trainer.allow_pickle) == (10.0, 0.5, True)
    with pytest.raises(ConfigError, match=r"reward.stop_fraction must be in \(0, 1\], got 0.0"):
        load_config(None, ["--reward.stop_fraction=0"])
    with pytest.raises(ConfigError, match=r"reward.stop_fraction must be in \(0, 1\], got 1.5"):
        load_config(None, ["--reward.stop_fraction=1.5"])
    with pytest.raises(ConfigError, match=r"reward.max_abs must be > 0 or null \(off\), got -1.0"):
        load_config(None, ["--reward.max_abs=-1"])


def test_kv_fp8_needs_a_recipe_that_rolls_out_in_fp8(tmp_path):
    default = RunConfig()
    assert not default.kv_fp8 and not default.kv_fp8_train
    jet = load_config(None, ["--recipe=jet", "--kv_fp8=true"])
    assert jet.kv_fp8 and jet.kv_fp8_train  # FP8 K/V in rollout and training alike
    peers = load_config(None, ["--recipe=fp8-rollout", "--kv_fp8=true"])
    assert peers.kv_fp8 and not peers.kv_fp8_train  # the rollout's cache only, the comparison arm
    assert load_config(None, ["--recipe=jet", "--kv_fp8=true", "--exact=true"]).kv_fp8_train
    with pytest.raises(ConfigError, match="kv_fp8: true .* recipe 'bf16' rolls out in BF16"):
        load_config(None, ["--recipe=bf16", "--kv_fp8=true"])
    path = tmp_path / "run.yaml"
    path.write_text("recipe: bf16\nkv_fp8: true\n")
    with pytest.raises(ConfigError, match="recipe 'bf16' rolls out in BF16"):
        load_config(path)
    with pytest.raises(ConfigTypeError, match="kv_fp8 must be a bool"):
        from_dict(RunConfig, {"kv_fp8": 2})


def test_kernel_settings_are_typed_and_checked_before_any_model(tmp_path):
    """``kernels``: KEY=VALUE settings of the kernels' tuning object for the whole run, typed by the field, checked
    by the object itself, reported as config errors; the file and the command line give them alike."""
    assert RunConfig().kernels == () and RunConfig().kernel_settings == {}
    cfg = load_config(None, ["--kernels=exact_split_k=1,kv_decode_factored=false"])
    assert cfg.kernel_settings == {"exact_split_k": 1, "kv_decode_factored": False}
    path = tmp_path / "run.yaml"
    path.write_text("kernels: [exact_cublas_min_m=0]\n")
    assert load_config(path).kernel_settings == {"exact_cublas_min_m": 0}
    for bad, message in ((["--kernels=exact_splitk=1"], "KEY a field of KernelTuning"),
                         (["--kernels=exact_split_k=one"], "exact_split_k must be int"),
                         (["--kernels=exact_split_k=-1"], "exact_split_k"),
                         (["--kernels=exact_split_k=1,exact_split_k=2"], "set twice"),
                         (["--kernels=decode_max_m_by_shape=1"], "cannot give")):
        with pytest.raises(ConfigError, match=message):
            load_config(None, bad)

