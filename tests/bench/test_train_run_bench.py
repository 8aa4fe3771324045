"""bench/train_run.py on CPU: ``jetrl train``'s own loop per recipe on a tiny Qwen2.5-shaped HF checkpoint, with a
trained tokenizer, GSM8K-like prompts and responses of varying length; the report's medians and ratios."""

from __future__ import annotations

import json

import pytest

from bench import train_run


def test_stop_ids_give_the_mean_length():
    ids = train_run.stop_ids(151936, 300, avoid={0, 5}, seed=1)
    assert len(ids) == round(151936 / 300) and not {0, 5} & set(ids) and ids == sorted(set(ids))


def test_coin_reward_is_a_fixed_coin():
    texts = [f"answer {i}" for i in range(200)]
    scores = [train_run.coin_reward(t, "") for t in texts]
    assert set(scores) == {0.0, 1.0} and scores == [train_run.coin_reward(t, "x") for t in texts]
    assert 60 < sum(scores) < 140


def test_generated_rows_when_the_data_is_missing(tmp_path):
    rows = train_run.gsm8k_rows(tmp_path / "missing.jsonl", 50, seed=0)
    assert len(rows) == 50 and all(r["answer"].split("#### ")[1].isdigit() for r in rows)
    lengths = {len(r["question"].split()) for r in rows}
    assert min(lengths) >= 20 and max(lengths) > min(lengths)  # of every length


def test_tiny_run_reports_every_recipe(tmp_path, capsys):
    path = tmp_path / "report.json"
    report = train_run.main(["--tiny", "--recipes", "bf16,jet", "--steps", "1", "--json", str(path),
                             "--workdir", str(tmp_path), "--data", str(tmp_path / "none.jsonl")])
    assert json.loads(path.read_text())["recipes"].keys() == {"bf16", "jet"}
    for recipe in ("bf16", "jet"):
        entry = report["recipes"][recipe]
        assert len(entry["steps"]) == 1
        med = entry["median"]
        assert med["time/update"] > 0 and med["time/rollout"] > 0 and med["response/num_tokens"] > 0
        assert entry["vs_bf16"]["step_wall"] > 0
    assert report["recipes"]["bf16"]["vs_bf16"]["update"] == pytest.approx(1.0)
    assert report["recipes"]["bf16"]["vs_bf16_per_token"]["update"] == pytest.approx(1.0)
    jet = report["recipes"]["jet"]
    for phase in ("step_wall", "rollout", "update"):  # the per-token ratio is the time ratio times the token ratio
        tokens = jet["median"]["response/num_tokens"] / report["recipes"]["bf16"]["median"]["response/num_tokens"]
        assert jet["vs_bf16_per_token"][phase] == pytest.approx(jet["vs_bf16"][phase] * tokens, rel=1e-9)
    assert report["data"] == "generated"
    assert jet["steady_steps"] == 0 and jet["steady"] == {}  # one step: only the first, which is never steady
    # on a GPU the steps carry the update's CUDA-graph captures so far; the table gives each step's new ones
    jet["steps"][0]["update/graph_captures"] = 3.0
    capsys.readouterr()
    train_run.print_table(report)
    out = capsys.readouterr().out
    assert "[3]" in out
    # and, since they are timed, the host seconds those captures took (cumulative in the metrics)
    jet["steps"][0]["update/graph_capture_seconds"] = 0.75
    train_run.print_table(report)
    assert "[3, 0.75 s]" in capsys.readouterr().out
    assert "jet         none: no step after the first" in out and "nan" not in out


def test_steady_steps_are_those_that_captured_no_graph():
    caps = [2, 5, 5, 7, 7, 7]  # the update's captures so far, after each step
    steps = [{"update/graph_captures": float(c), "time/update": float(i), "time/rollout_graph_capture": 0.0}
             for i, c in enumerate(caps)]
    steps[4]["time/rollout_graph_capture"] = 0.8  # a decode-step capture makes a step unsteady too
    assert [m["time/update"] for m in train_run.steady_steps(steps)] == [2.0, 5.0]
    assert [m["time/update"] for m in train_run.steady_steps(steps, skip=3)] == [5.0]
    result = {"steps": steps}
    assert train_run.summarize(result, steady=True)["time/update"] == 3.5
    assert train_run.summarize({"steps": steps[:2]}, steady=True) == {}  # none steady: no medians
    cpu = [{"time/update": 1.0}, {"time/update": 2.0}]  # no graphs (CPU): every step after the first
    assert train_run.steady_steps(cpu) == cpu[1:]


def test_recipes_need_the_baseline():
    with pytest.raises(SystemExit):
        train_run.main(["--tiny", "--recipes", "jet"])


def test_set_overrides_every_recipe_config(tmp_path):
    """``--set`` passes config overrides through (after the benchmark's own, so they win)."""
    parser_args = ["--set", "model.checkpoint_blocks=3", "--set=--algorithm.max_tokens_per_micro_batch=4096",
                   "--set", "model.gradient_checkpointing=true"]
    args = train_run.parse_args(parser_args)
    config = train_run.build_base_config(args, tmp_path / "ckpt", tmp_path / "data.jsonl", 1000, set())
    assert config.model.checkpoint_blocks == 3 and config.model.gradient_checkpointing
    assert config.algorithm.max_tokens_per_micro_batch == 4096  # the benchmark's own --micro-tokens default lost


def test_responses_run_to_max_tokens_in_the_to_max_setting(tmp_path):
    """``--setting to-max``: no stop ids and EOS ignored, so every response is ``max_tokens`` long (what a fresh
    policy's responses often do); ``long``'s defaults are 8 prompts and 4,096 tokens."""
    assert train_run.stop_ids(151936, 0, avoid=set(), seed=1) == []
    report = train_run.main(["--tiny", "--setting", "to-max", "--recipes", "bf16", "--steps", "1", "--workdir",
                             str(tmp_path), "--data", str(tmp_path / "none.jsonl")])
    step = report["recipes"]["bf16"]["steps"][0]
    assert step["response/num_tokens"] == 2 * 2 * 24  # prompts x n x max_tokens (the tiny sizes)
    assert report["setting"]["name"] == "to-max" and report["setting"]["mean_response"] == 0
    args = train_run.parse_args(["--setting", "long"])
    assert (args.prompts, args.max_tokens, args.mean_response) == (8, 4096, 0)
