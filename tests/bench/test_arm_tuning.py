"""An arm's own kernel tuning (``<recipe>[+kv8][-exact]@KEY=VALUE[;KEY=VALUE...]``): its grammar, canonical names
and errors (bench/common.py), and CPU runs of bench/rollout.py and bench/rl_step.py with two arms that differ only
by tuning, each arm's work recorded from inside the engine and the model to have run under its own settings."""

from __future__ import annotations

import importlib
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def common(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # bench/ is a folder of scripts, importable from the root
    return importlib.import_module("bench.common")


# ------------------------------------------------------------------------------------------------ grammar

def test_tuned_arms_parse_typed_and_round_trip(common):
    Arm, parse_arm = common.Arm, common.parse_arm
    assert parse_arm("jet-exact@exact_split_k=0") == Arm("jet", exact=True, tuning={"exact_split_k": 0})
    arm = parse_arm(" jet+kv8 @ kv_decode_factored = 1 ; exact_split_k=2")
    assert (arm.recipe, arm.kv_fp8, arm.exact) == ("jet", True, False)
    assert dict(arm.tuning) == {"exact_split_k": 2, "kv_decode_factored": True}
    assert type(arm.tuning["exact_split_k"]) is int and arm.tuning["kv_decode_factored"] is True
    # canonical: keys sorted by name, bools true/false, no spaces; the name parses back to the same arm
    assert arm.name == "jet+kv8@exact_split_k=2;kv_decode_factored=true"
    assert list(arm.tuning) == ["exact_split_k", "kv_decode_factored"]
    for name in ["bf16", "jet+kv8-exact", "jet-exact@exact_split_k=0", "jet@gemm=triton;kv_decode_block_n=64",
                 "jet+kv8@kv_decode_factored=false", "jet+kv8-exact@exact_split_k=4;kv_decode_factored=true"]:
        assert parse_arm(name).name == name
        assert parse_arm(parse_arm(name).name) == parse_arm(name)
    assert parse_arm("jet@kv_decode_block_n=64;gemm=triton").name == "jet@gemm=triton;kv_decode_block_n=64"
    assert parse_arm("jet+kv8@kv_decode_factored=0").name == "jet+kv8@kv_decode_factored=false"
    # the order a mapping is given in does not matter to equality, hashing or the name
    a = Arm("jet", tuning={"kv_decode_factored": True, "exact_split_k": 0})
    b = Arm("jet", tuning={"exact_split_k": 0, "kv_decode_factored": True})
    assert a == b and hash(a) == hash(b) and a.name == b.name and len({a, b}) == 1
    assert a != Arm("jet") and Arm("jet").name == "jet" and not Arm("jet").tuning
    with pytest.raises(TypeError):
        a.tuning["exact_split_k"] = 3  # read-only


@pytest.mark.parametrize("name, match", [
    ("jet@", "no empty setting"), ("jet@exact_split_k=0;", "no empty setting"),
    ("jet@nonsense=1", "field of KernelTuning"), ("jet@exact_split_k", "field of KernelTuning"),
    ("jet@exact_split_k=two", "exact_split_k must be int"), ("jet@exact_split_k=-1", "non-negative"),
    ("jet+kv8@kv_decode_factored=maybe", "true or false"), ("jet@gemm=fastest", "must be one of"),
    ("jet@exact_split_k=0;exact_split_k=2", "set twice"), ("jet@decode_policies=x", "setting cannot give"),
    ("bf16+kv8@kv_decode_factored=true", "rolls out in BF16"), ("fp9@exact_split_k=0", "unknown recipe"),
])
def test_bad_arm_tunings_name_the_arm(common, name, match):
    with pytest.raises(ValueError, match=match) as info:
        common.parse_arm(name)
    assert f"arm {name!r}" in str(info.value)


def test_arm_lists_may_differ_by_tuning_only(common):
    arms = common.parse_arms("bf16,jet+kv8,jet+kv8@kv_decode_factored=true")
    assert [a.name for a in arms] == ["bf16", "jet+kv8", "jet+kv8@kv_decode_factored=true"]
    for twice in ("jet,jet", "jet@kv_decode_factored=1,jet@kv_decode_factored=true",
                  "jet@exact_split_k=0;gemm=triton,jet@gemm=triton;exact_split_k=0"):
        with pytest.raises(ValueError, match="twice"):
            common.parse_arms(twice)


def test_an_exact_arm_is_set_against_its_fast_arm(common):
    arm = common.parse_arm
    names = ["bf16", "jet", "jet+kv8", "jet+kv8@kv_decode_factored=true"]
    assert common.fast_arm_of(arm("jet-exact"), names) == "jet"
    assert common.fast_arm_of(arm("jet-exact@exact_split_k=0"), names) == "jet"  # no tuned fast arm: the plain one
    assert common.fast_arm_of(arm("jet+kv8-exact@kv_decode_factored=true"), names) == "jet+kv8@kv_decode_factored=true"
    assert common.fast_arm_of(arm("bf16-exact"), names) == "bf16"
    assert common.fast_arm_of(arm("jet"), names) is None and common.fast_arm_of(arm("jet-exact"), ["bf16"]) is None


@pytest.mark.parametrize("script", ["rollout", "rl_step"])
def test_bad_tunings_are_usage_errors_before_any_model(common, script, monkeypatch, capsys):
    import jetrl.models

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built before the arms were checked")

    monkeypatch.setattr(jetrl.models, "build_model", no_model)
    bench = importlib.import_module(f"bench.{script}")
    for argv in (["--tiny", "--arms", "bf16,jet@exact_split_k=x"], ["--tiny", "--arms", "jet@nonsense=1"],
                 ["--tiny", "--tuning", "exact_split_k=1", "--tuning", "exact_split_k=2"]):
        with pytest.raises(SystemExit):
            bench.main(argv)
    assert "arm 'jet@nonsense=1'" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- arms in force, end to end

def _record_tuning(monkeypatch, seen: list):
    """Patch the engine's construction and decode/prefill forward, the FP8 weights' refresh, the training-side
    forward and log-probabilities to append ``(where, exact_split_k, kv_decode_factored)`` of the tuning in force
    at the call."""
    import jetrl.models
    import jetrl.quant
    from jetrl.models import DecoderLM
    from jetrl.quant.kernels import tuning
    from jetrl.rollout import RolloutEngine
    from jetrl.rollout.model_runner import ModelRunner

    def recording(where, fn):
        def wrapper(*args, **kwargs):
            now = tuning.current()
            seen.append((where, now.exact_split_k, now.kv_decode_factored))
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(RolloutEngine, "__init__", recording("engine", RolloutEngine.__init__))
    monkeypatch.setattr(ModelRunner, "_launch", recording("generate", ModelRunner._launch))
    monkeypatch.setattr(DecoderLM, "forward_packed", recording("train", DecoderLM.forward_packed))
    monkeypatch.setattr(jetrl.quant, "refresh_fp8_weights", recording("refresh", jetrl.quant.refresh_fp8_weights))
    monkeypatch.setattr(jetrl.models, "token_logprobs", recording("score", jetrl.models.token_logprobs))


def _runs(seen: list) -> list[tuple[int, bool]]:
    """The tuning of each run of consecutive records (an arm, or arms of equal tuning one after another)."""
    runs: list[tuple[int, bool]] = []
    for _, split, factored in seen:
        if not runs or runs[-1] != (split, factored):
            runs.append((split, factored))
    return runs


def test_rollout_runs_each_arm_under_its_own_tuning(common, one_thread, monkeypatch, tmp_path, capsys):
    from jetrl.quant.kernels import tuning

    bench = importlib.import_module("bench.rollout")
    seen: list = []
    _record_tuning(monkeypatch, seen)
    tuned = "jet+kv8@exact_split_k=0;kv_decode_factored=false"
    results = bench.main(["--tiny", "--settings", "tiny", "--arms", "bf16,jet+kv8,jet+kv8@kv_decode_factored=0;exact_split_k=0",
                          "--mismatch", "--tuning", "exact_split_k=2", "--json", str(tmp_path / "r.json")])
    assert tuning.current().exact_split_k == 0 and tuning.current().kv_decode_factored  # restored after
    base, own = (2, True), (0, False)  # the run's --tuning; the tuned arm's settings win over it
    # bf16 and jet+kv8 under the run's tuning, then the tuned arm under its own (one setting: the CPU is slow)
    assert _runs(seen) == [base, own]
    for where in ("refresh", "engine", "generate", "score"):
        assert {(s, f) for w, s, f in seen if w == where} == {base, own}, where
    assert sum(1 for w, s, f in seen if w == "engine" and (s, f) == own) == 1  # one engine per arm and setting
    for r in results:
        assert list(r.decode_tokens_per_s) == ["bf16", "jet+kv8", tuned]
        assert r.tuning == {"bf16": {"exact_split_k": 2}, "jet+kv8": {"exact_split_k": 2},
                            tuned: {"exact_split_k": 0, "kv_decode_factored": False}}
        assert r.over_bf16[tuned] == r.decode_tokens_per_s[tuned] / r.decode_tokens_per_s["bf16"]
        assert set(r.over_bf16) == {"jet+kv8", tuned} and set(r.mismatch_max) == {"bf16", "jet+kv8", tuned}
    written = json.loads((tmp_path / "r.json").read_text())
    assert written[0]["tuning"][tuned] == {"exact_split_k": 0, "kv_decode_factored": False}
    assert tuned in capsys.readouterr().out.splitlines()[-1]  # the table's last row


def test_rl_step_runs_each_arm_under_its_own_tuning(common, one_thread, monkeypatch, tmp_path, capsys):
    from jetrl.quant.kernels import tuning

    bench = importlib.import_module("bench.rl_step")
    seen: list = []
    _record_tuning(monkeypatch, seen)
    monkeypatch.setenv("OUT", str(tmp_path))
    tuned = "jet-exact@exact_split_k=2"
    report = bench.main(["--tiny", "--warmup", "0", "--steps", "1", "--prompt-len", "4", "--new-tokens", "4",
                         "--no-reference", "--arms", f"bf16,{tuned}", "--exact",
                         "--tuning", "kv_decode_factored=false"])
    assert tuning.current().exact_split_k == 0 and tuning.current().kv_decode_factored  # restored after
    results = report["results"]
    assert list(results) == ["bf16", tuned, "jet-exact"]  # --exact still adds the untuned exact arm
    base, own = (0, False), (2, False)  # the defaults updated by --tuning; the tuned arm's own setting wins
    assert _runs(seen) == [base, own, base]
    for where in ("engine", "generate", "train"):
        assert {(s, f) for w, s, f in seen if w == where} == {base, own}, where
    assert [results[a]["tuning"] for a in results] == [
        {"kv_decode_factored": False}, {"exact_split_k": 2, "kv_decode_factored": False}, {"kv_decode_factored": False}]
    assert report["tuning"] == {"kv_decode_factored": False}
    for arm in (tuned, "jet-exact"):  # both exact routes: the engine's log-probs equal the trainer's
        assert results[arm]["step_metrics"]["mismatch/logp_abs_diff_max"] == 0.0
        assert report["speedups_over_bf16"][arm]["total"] == pytest.approx(
            results["bf16"]["seconds"]["total"] / results[arm]["seconds"]["total"])
    written = json.loads((tmp_path / "rl_step.json").read_text())
    assert written["results"][tuned]["tuning"] == {"exact_split_k": 2, "kv_decode_factored": False}
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("phase"))
    assert f"{tuned} s" in header and f"{tuned}/bf16" in header


@pytest.mark.parametrize("script", ["rollout", "rl_step"])
def test_the_documented_commands_parse(common, script):
    import re
    import shlex

    bench = importlib.import_module(f"bench.{script}")
    command = re.search(rf"python3 bench/{script}\.py (--arms '[^']*')", bench.__doc__).group(1)
    args = bench._parse(shlex.split(command))
    names = [a.name for a in args.arms] if script == "rollout" else args.recipes
    assert len(names) == 3 and "@" in names[-1] and names[-1] == shlex.split(command)[1].split(",")[-1]
    example = re.search(r'``parse_arm\("([^"]*)"\)\.name`` is\s+``"([^"]*)"``', common.Arm.__doc__)
    assert common.parse_arm(example.group(1)).name == example.group(2)
