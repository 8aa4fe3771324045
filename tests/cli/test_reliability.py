"""Issue 20 at the command line: failures that used to be silent, folders that used to be overwritten, and
mistakes that used to end in a traceback, each now one ``jetrl: error:`` line (or a warning) before any
slow work."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from jetrl.asset_files import EMBEDDED_MODEL, resolve_asset
from jetrl.cli import main
from jetrl.data import read_prompts

from cli_errors import error_line, parser_error

# a short run of the embedded model: one step of 4 prompts x 2 samples
TINY = ["--no-progress", "--eval-examples", "0", "--max-steps", "1", "--data.prompts_per_step=4", "--rollout.n=2",
        "--algorithm.mini_batch_size=8", "--algorithm.micro_batch_size=8"]


_error = error_line
_argparse_error = parser_error


def test_version(capsys):
    from jetrl import __version__

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"jetrl {__version__}"


def test_counts_must_be_positive(capsys):
    assert "argument --num-examples: must be >= 1, got 0" in _argparse_error(capsys, ["eval", "--num-examples", "0"])
    assert "argument --m: must be >= 1, got 0" in _argparse_error(capsys, ["check-fp8", "--m", "0"])
    assert "argument --max-tokens: must be >= 1, got -3" in _argparse_error(capsys, ["generate", "--max-tokens",
                                                                                     "-3", "x"])
    assert "argument --threads: must be >= 1, got -1" in _argparse_error(capsys, ["generate", "--threads", "-1", "1+2"])
    assert "argument --threads: must be >= 1, got 0" in _argparse_error(capsys, ["train", "--threads", "0"])


def test_bench_accepts_only_the_shipped_names(capsys, tmp_path):
    evil = tmp_path / "evil.py"
    evil.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\ndef main(argv): pass\n")
    relative = os.path.relpath(evil.with_suffix(""), Path(__file__).resolve().parents[2] / "bench")
    msg = _error(capsys, ["bench", relative])
    assert msg.startswith(f"jetrl: error: unknown benchmark {relative!r}; available: fp8")
    assert not (tmp_path / "ran").exists()


def test_prompt_files_keep_non_ascii_text(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("café au lait\nline one\\nline two\n", encoding="utf-8")
    assert read_prompts([], str(prompts)) == ["café au lait", "line one\nline two"]
    prompts.write_bytes("caf\u00e9\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"p.txt line 1 is not UTF-8 text"):
        read_prompts([], str(prompts))
    rows = tmp_path / "p.jsonl"
    rows.write_text('{"prompt": "é"}\n\n{"text": "no prompt"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"p.jsonl:3: no 'prompt' field"):  # its line, blank lines counted
        read_prompts([], str(rows))
    rows.write_text('{"prompt": "é"}\n\n{"prompt": 2}\n', encoding="utf-8")
    assert read_prompts(["a"], str(rows)) == ["a", "é", "2"]
    for suffix in (".ndjson", ".JSONL"):  # named as a dataset file may be: rows, not raw lines
        other = rows.with_suffix(suffix)
        other.write_text('{"prompt": "What is 2+2?"}\n', encoding="utf-8")
        assert read_prompts([], str(other)) == ["What is 2+2?"]
    for bad in ("null", '["a", "b"]'):
        rows.write_text(f'{{"prompt": "ok"}}\n{{"prompt": {bad}}}\n', encoding="utf-8")
        with pytest.raises(ValueError, match=r"p.jsonl: row 2's 'prompt' is a (NoneType|list), not text"):
            read_prompts([], str(rows))


def test_malformed_config_and_output_folder_under_a_file(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1,\n")
    assert "bad.yaml line 2 column 1 is not valid YAML" in _error(capsys, ["train", str(bad)])
    (tmp_path / "afile").write_text("")
    # refused at once, before the 200-problem evaluation that precedes training
    msg = _error(capsys, ["train", "--output-dir", "afile/run"])
    assert msg == "jetrl: error: trainer.output_dir afile/run cannot be created: afile is a file"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_on_a_cpu_machine(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert "device 'cuda' was asked for but" in _error(capsys, ["train", "--model.device=cuda"])
    assert "device 'cuda' was asked for but" in _error(capsys, ["generate", "--device", "cuda", "1+2"])


def test_generation_past_the_model_context_is_refused_before_loading(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = _error(capsys, ["train", "--rollout.max_tokens=1000"])
    assert msg == ("jetrl: error: data.max_prompt_tokens + rollout.max_tokens = 1064 tokens exceed the model's "
                   "context of 512 positions (max_position_embeddings in its config.json); lower them")
    assert not (tmp_path / "runs" / "tiny-default" / "config.yaml").exists()
    msg = _error(capsys, ["generate", "--max-tokens", "600", "1+2"])
    assert "--max-tokens plus one prompt token = 601 tokens exceed the model's context of 512" in msg


def test_a_tokenizer_of_another_model_is_refused(capsys, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(resolve_asset(EMBEDDED_MODEL), other)
    config = json.loads((other / "config.json").read_text())
    config["bos_token_id"] = 5  # same vocabulary size, different special tokens
    (other / "config.json").write_text(json.dumps(config))
    msg = _error(capsys, ["generate", "--model", str(other), "1+2"])
    assert "has BOS id 1 but the model's config.json has bos_token_id=5" in msg


def test_top_k_beyond_the_vocabulary_warns():
    from jetrl.config import load_config
    from jetrl.rl.loop import check_model

    config = load_config(resolve_asset("jetrl:tiny_default.yaml"), ["--rollout.top_k=1000"])
    config.model.path = resolve_asset(config.model.path)
    with pytest.warns(UserWarning, match=r"rollout.top_k=1000 is larger than the vocabulary \(26 tokens\)"):
        check_model(config)


def test_a_temperature_too_small_for_float32_is_refused_before_loading(capsys, tmp_path, monkeypatch):
    """rollout.temperature=1e-39 passed the config's "> 0"; the rollout then divided the logits by it (inf) and
    sampled from NaN log-probs."""
    monkeypatch.chdir(tmp_path)
    msg = _error(capsys, ["train", "--rollout.temperature=1e-39"])
    assert msg.startswith("jetrl: error: rollout: SamplingParams.temperature 1e-39 is below 1e-05")
    assert "use 0 for greedy" in msg


def test_more_checkpointed_blocks_than_the_model_has_are_refused_before_loading(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = _error(capsys, ["train", "--model.gradient_checkpointing=true", "--model.checkpoint_blocks=9"])
    assert msg.startswith("jetrl: error: model.checkpoint_blocks (9) is more than the model's ")
    assert msg.endswith(" decoder blocks")
    assert not (tmp_path / "runs" / "tiny-default" / "config.yaml").exists()


def test_more_prompts_per_step_than_the_dataset(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    msg = _error(capsys, ["train", "--data.num_examples=4", "--data.prompts_per_step=8", "--eval-examples", "0"])
    assert msg == ("jetrl: error: data.prompts_per_step (8) is larger than the dataset (4 prompts); lower it or use "
                   "more data")


def test_one_run_per_output_folder(capsys, tmp_path, monkeypatch):
    """Another run's checkpoints make a fresh run refuse (naming --resume, --output-dir and --overwrite);
    --resume=must without a checkpoint fails, plain --resume warns and starts at step 0; --overwrite
    deletes the old run's outputs before the new run."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "runs" / "tiny-default"
    msg = _error(capsys, ["train", "--resume=must", *TINY])
    assert msg == f"jetrl: error: nothing to resume: {Path('runs/tiny-default/checkpoints')} holds no checkpoint"
    assert main(["train", "--resume", *TINY]) == 0
    warning = "jetrl: warning: nothing to resume in runs/tiny-default/checkpoints; starting from step 0"
    assert warning in capsys.readouterr().err.splitlines()
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000001"]
    (out / "checkpoints" / "step_00000040").mkdir()  # a longer earlier run's newest checkpoint
    msg = _error(capsys, ["train", *TINY])
    assert msg == ("jetrl: error: runs/tiny-default holds the checkpoints of another run (up to step 40): continue it "
                   "with --resume (trainer.resume=true), write the new run elsewhere with --output-dir "
                   "(trainer.output_dir), or delete the old run first with --overwrite")
    msg = _error(capsys, ["train", "--overwrite", "--resume", *TINY])  # contradictory
    assert "overwrite deletes the run that resume would continue" in msg
    (out / "eval.json").write_text("{}")
    assert main(["train", "--overwrite", *TINY]) == 0
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000001"]
    assert not (out / "eval.json").exists()
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]


def _unanswerable(tmp_path) -> Path:
    """Prompts whose references hold no number: the arithmetic reward raises on every sample."""
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+1\n", "answer": "unknown"}) for i in range(8)))
    return data


def test_a_broken_reward_stops_training_with_one_line(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = _unanswerable(tmp_path)
    msg = _error(capsys, ["train", "--data.task=none", f"--data.path={data}", "--data.reward=arithmetic", *TINY],
                 status=1)
    assert msg.startswith("jetrl: error: the reward failed for 8 of 8 samples (8 errors, 0 timeouts), at least 1 "
                          "of them; stopping the run. First failure: sample 0: ValueError: arithmetic reference")


def test_a_broken_reward_does_not_read_as_zero_accuracy(capsys, tmp_path):
    data = _unanswerable(tmp_path)
    msg = _error(capsys, ["eval", "--data", str(data), "--reward", "arithmetic", "--no-progress"], status=1)
    assert "the reward failed for 8 of 8 samples" in msg


def test_summaries_show_failed_rewards(tmp_path):
    from jetrl.evaluate import EvalResult
    from jetrl.plotting import summarize_run

    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 5):
            f.write(json.dumps({"step": step, "reward/mean": 0.5, "reward/accuracy": 0.5, "reward/errors": step % 2,
                                "reward/timeouts": 1 if step == 4 else 0}) + "\n")
    rows = dict(summarize_run(tmp_path))
    assert rows["failed rewards (all steps)"] == "2 errors, 1 timeouts"
    assert "reward = accuracy (first 1 -> last 1 steps)" in rows and not any(k.startswith("accuracy") for k in rows)
    result = EvalResult(num_prompts=1, n=1, accuracy=0.0, mean_reward=0.0, pass_at_k={1: 0.0}, mean_length=1.0,
                        truncation_rate=0.0, reward_errors=3, reward_timeouts=1)
    assert dict(result.rows())["failed rewards"] == "3 errors, 1 timeouts"


def test_plot_of_several_runs_leaves_their_own_plots_alone(tmp_path, capsys):
    runs = []
    for name in ("a", "b"):
        run = tmp_path / name
        run.mkdir()
        (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")
        (run / "curves.png").write_bytes(b"own plot")
        runs.append(str(run))
    assert main(["plot", *runs]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "curves_a_vs_b.png")
    assert (tmp_path / "curves_a_vs_b.png").read_bytes()[:4] == b"\x89PNG"
    assert all((Path(r) / "curves.png").read_bytes() == b"own plot" for r in runs)


def test_export_into_a_non_empty_folder(capsys, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "config.json").write_text("{}")
    msg = _error(capsys, ["export", EMBEDDED_MODEL, str(tmp_path / "out")])
    assert msg.startswith("jetrl: error: the export destination") and "--overwrite" in msg
    assert (tmp_path / "out" / "config.json").read_text() == "{}"
    assert main(["export", EMBEDDED_MODEL, str(tmp_path / "out"), "--overwrite"]) == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"


def test_sft_resume_checkpoints_and_refusal_at_the_command_line(capsys, tmp_path):
    out = tmp_path / "tiny"
    small = ["sft", "--output-dir", str(out), "--steps", "2", "--batch-size", "4", "--eval-examples", "2",
             "--no-progress"]
    assert main([*small, "--resume", "--checkpoint-every", "1", "--keep-checkpoints"]) == 0
    assert f"sft: nothing to resume in {out / 'checkpoints'}; starting from step 0" in capsys.readouterr().err
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))[-1] == "step_00000002"
    msg = _error(capsys, small)  # a fresh run over the kept checkpoints
    assert msg.startswith(f"jetrl: error: sft: {out / 'checkpoints'} holds the checkpoints of an interrupted run; "
                          "continue it with resume (jetrl sft --resume)")


def test_reward_section_reaches_the_pool_and_the_guard(capsys, tmp_path, monkeypatch):
    """reward.max_abs bounds the rewards (operator.ne scores 1.0 for every completion that differs from its
    reference, so a bound of 0.5 fails them all); reward.stop_fraction=0.5 stops a run in which half of a
    step's samples failed, which the default (1.0) only reports."""
    monkeypatch.chdir(tmp_path)
    msg = _error(capsys, ["train", "--data.reward=operator:ne", "--reward.max_abs=0.5", *TINY], status=1)
    assert "the reward failed for 8 of 8 samples" in msg and "reward 1 is beyond max_abs_reward=0.5" in msg
    data = tmp_path / "half.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+1\n", "answer": "unknown" if i % 2 else str(i + 1)})
                              for i in range(4)))
    half = ["--data.task=none", f"--data.path={data}", "--data.reward=arithmetic", "--data.shuffle=false"]
    msg = _error(capsys, ["train", *half, "--reward.stop_fraction=0.5", "--output-dir", "half", *TINY], status=1)
    assert "the reward failed for 4 of 8 samples (4 errors, 0 timeouts), at least 0.5 of them" in msg


def test_allow_pickle_reaches_resume(tmp_path, monkeypatch):
    import jetrl.rl.loop as loop
    from jetrl.config import load_config

    seen = {}

    class Stop(Exception):
        pass

    def record(trainer, root, allow_pickle=False):
        seen["allow_pickle"] = allow_pickle
        raise Stop

    monkeypatch.setattr(loop, "resume_trainer", record)
    for value in (False, True):
        config = load_config(resolve_asset("jetrl:tiny_default.yaml"),
                             ["--trainer.resume=true", f"--trainer.allow_pickle={str(value).lower()}",
                              f"--trainer.output_dir={tmp_path / 'run'}"])
        config.model.path = resolve_asset(config.model.path)
        with pytest.raises(Stop), pytest.warns(RuntimeWarning, match="nothing to resume"):
            loop.run(config)
        assert seen["allow_pickle"] is value


def test_evaluation_prompts_must_fit_the_context():
    from jetrl.evaluate import generate_texts
    from jetrl.models import load_model, load_tokenizer

    folder = resolve_asset(EMBEDDED_MODEL)
    model, tokenizer = load_model(folder, dtype=torch.float32, device="cpu"), load_tokenizer(folder)
    with pytest.raises(ValueError, match=r"^prompt 0 has \d+ tokens; with max_tokens=510 that exceeds the model's "
                                         r"context of 512 positions \(max_position_embeddings\); lower max_tokens$"):
        generate_texts(model, tokenizer, ["12+7-3*2"], max_tokens=510)
