"""Supervised warm-start: answer-only targets, the schedule, and a short run that writes a loadable checkpoint."""

import json

import pytest
import torch

from jetrl.sft.train import SFTConfig, encode_example, lr_at, pad_batch, run_sft
from jetrl.sft.tokenizer import build_char_tokenizer


def test_targets_cover_solution_and_eos_only():
    tok = build_char_tokenizer()
    seq, prompt_len = encode_example(tok, "2+3\n", "2+3=5\n#### 5")
    assert prompt_len == 5 and seq[-1] == tok.eos_token_id  # <bos> 2 + 3 \n
    short, short_len = encode_example(tok, "9\n", "#### 9")
    ids, targets = pad_batch([(seq, prompt_len), (short, short_len)], tok.pad_token_id)
    assert ids.shape == (2, len(seq))
    # row 0: position i predicts token i+1; only the solution tokens and <eos> are targets
    expected = [-1] * (prompt_len - 1) + seq[prompt_len:] + [-1]
    assert targets[0].tolist() == expected
    assert targets[1, short_len - 1:len(short) - 1].tolist() == short[short_len:]
    assert (targets[1, len(short) - 1:] == -1).all() and (ids[1, len(short):] == tok.pad_token_id).all()
    assert (targets[1, :short_len - 1] == -1).all()


def test_a_short_run_warms_up_for_a_tenth_of_its_steps_and_decays():
    """The default warm-up is min(50, steps // 10): a 20-step run reaches lr at its third step and ends at the
    floor (with 50 steps of warm-up it never reached a fifth of lr); a given warm-up is kept."""
    short = SFTConfig(steps=20, lr=1e-3, min_lr_ratio=0.1)
    assert short.warmup_steps == 2 and SFTConfig().warmup_steps == 50
    assert lr_at(2, short) == pytest.approx(1e-3) and lr_at(20, short) == pytest.approx(1e-4)
    assert SFTConfig(steps=20, warmup_steps=7).warmup_steps == 7


def test_lr_schedule_warmup_then_cosine_floor():
    c = SFTConfig(steps=100, warmup_steps=10, lr=1e-3, min_lr_ratio=0.1)
    assert lr_at(0, c) == pytest.approx(1e-4) and lr_at(9, c) == pytest.approx(1e-3)
    assert lr_at(10, c) == pytest.approx(1e-3)
    assert lr_at(100, c) == pytest.approx(1e-4)
    assert all(lr_at(s, c) >= lr_at(s + 1, c) for s in range(10, 100))


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="steps"):
        SFTConfig(steps=0)
    with pytest.raises(ValueError, match="differ"):
        SFTConfig(train_seed=3, eval_seed=3)


def test_short_run_lowers_loss_and_writes_a_loadable_checkpoint(tmp_path):
    from transformers import AutoTokenizer

    from jetrl.models import load_model

    config = SFTConfig(output_dir=str(tmp_path / "m"), difficulty=1, steps=30, batch_size=16, hidden_size=32,
                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
                       eval_examples=8, warmup_steps=5, log_every=5, lr=1e-2)
    result = run_sft(config, progress=False, log=lambda m: None)
    history = json.loads((tmp_path / "m" / "sft_metrics.json").read_text())["history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert losses[-1] < 0.8 * losses[0]  # uniform guessing over 26 ids is ~3.3 nats
    assert 0.0 <= result.accuracy <= 1.0
    model = load_model(tmp_path / "m", dtype=torch.float32)
    assert model.config.tie_word_embeddings and model.config.vocab_size == 26
    assert AutoTokenizer.from_pretrained(tmp_path / "m").eos_token_id == model.config.eos_token_id


# ------------------------------------------------------------------------------ interrupted runs resume

TINY = dict(difficulty=1, steps=12, batch_size=8, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, intermediate_size=64, eval_examples=4, warmup_steps=3, log_every=4, lr=1e-2,
            checkpoint_every=5)


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def test_an_interrupted_run_resumes_to_the_weights_of_an_uninterrupted_one(tmp_path, monkeypatch):
    import jetrl.sft.train as sft

    straight = run_sft(SFTConfig(output_dir=str(tmp_path / "straight"), **TINY), progress=False, log=lambda m: None)
    assert not (tmp_path / "straight" / "checkpoints").exists()  # removed once the final model is written

    config = SFTConfig(output_dir=str(tmp_path / "cut"), **TINY)
    real_loss, calls = sft.answer_loss, []

    def killed_at_step_8(*args):
        calls.append(1)
        if len(calls) == 9:
            raise KeyboardInterrupt  # Ctrl-C during step 8, after the checkpoint of step 5
        return real_loss(*args)

    monkeypatch.setattr(sft, "answer_loss", killed_at_step_8)
    with pytest.raises(KeyboardInterrupt):
        run_sft(config, progress=False, log=lambda m: None)
    monkeypatch.setattr(sft, "answer_loss", real_loss)
    assert sorted(p.name for p in (tmp_path / "cut" / "checkpoints").iterdir()) == ["step_00000005"]

    with pytest.raises(FileExistsError, match="interrupted run.*--resume"):
        run_sft(config, progress=False, log=lambda m: None)  # a fresh run would discard them: refused
    with pytest.raises(ValueError, match=r"other settings \(lr: 0.01 -> 0.02\)"):
        run_sft(SFTConfig(output_dir=str(tmp_path / "cut"), **{**TINY, "lr": 2e-2}), progress=False,
                log=lambda m: None, resume=True)

    lines = []
    resumed = run_sft(config, progress=False, log=lines.append, resume=True)
    assert any("resuming from" in line and "step 5 of 12" in line for line in lines), lines
    assert any(line.startswith("sft step 8/12") and "left" in line for line in lines), lines  # a time estimate
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "cut")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.final_loss == straight.final_loss
    history = [json.loads((tmp_path / d / "sft_metrics.json").read_text())["history"] for d in ("straight", "cut")]
    assert history[0] == history[1]


def test_resume_with_nothing_to_resume_says_so_and_keep_checkpoints(tmp_path):
    lines = []
    run_sft(SFTConfig(output_dir=str(tmp_path / "m"), keep_checkpoints=True, **{**TINY, "steps": 6}),
            progress=False, log=lines.append, resume=True)
    assert "nothing to resume" in lines[0]
    # kept: the last checkpoint (step 6); resuming from it only re-writes the final model
    assert sorted(p.name for p in (tmp_path / "m" / "checkpoints").iterdir()) == ["step_00000006"]
    with pytest.raises(ValueError, match="checkpoint_every"):
        SFTConfig(checkpoint_every=-1)


def test_format_duration():
    from jetrl.sft.train import format_duration

    assert [format_duration(s) for s in (0.4, 42, 185, 3725)] == ["0s", "42s", "3m05s", "1h02m"]


# ------------------------------------------------------------------------------ packing and BF16

def _chain_examples(tok, num, difficulty=(1, 12), seed=0):
    from jetrl.data.tasks import ChainTask

    return [encode_example(tok, ex.prompt, ex.solution) for ex in ChainTask(difficulty, seed=seed).examples(num)]


def test_packs_hold_the_padded_targets_without_padding():
    from jetrl.sft.train import pack_examples

    tok = build_char_tokenizer()
    examples = _chain_examples(tok, 9)
    ids, targets = pad_batch(examples, tok.pad_token_id)
    lengths = [len(seq) for seq, _ in examples]
    packs = pack_examples(examples, max_tokens=max(lengths) * 3)
    assert 1 < len(packs) < len(examples)
    assert all(p.cu_seqlens[-1] == p.input_ids.numel() <= max(lengths) * 3 for p in packs)
    flat_ids = torch.cat([p.input_ids for p in packs])
    flat_targets = torch.cat([p.targets for p in packs])
    assert flat_ids.tolist() == [t for b, L in enumerate(lengths) for t in ids[b, :L].tolist()]
    assert flat_targets.tolist() == [t for b, L in enumerate(lengths) for t in targets[b, :L].tolist()]
    assert torch.cat([p.positions for p in packs]).tolist() == [i for L in lengths for i in range(L)]
    assert sum(p.num_targets for p in packs) == int((targets >= 0).sum())
    assert len(pack_examples(examples, max_tokens=sum(lengths))) == 1
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        pack_examples(examples, max_tokens=max(lengths) - 1)


def test_packed_and_padded_give_the_same_loss_and_gradients():
    from jetrl.models import build_model
    from jetrl.sft.train import answer_loss, pack_examples, packed_answer_loss

    tok = build_char_tokenizer()
    config = SFTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64)
    model = build_model(config.model_config(tok), dtype=torch.float32, seed=3)
    examples = _chain_examples(tok, 8, seed=1)
    ids, targets = pad_batch(examples, tok.pad_token_id)
    padded = answer_loss(model, ids, targets)
    padded.backward()
    padded_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    packs = pack_examples(examples, max_tokens=200)
    assert len(packs) > 1  # accumulation over micro-batches, normalised by the step's target count
    num_targets = sum(p.num_targets for p in packs)
    packed = 0.0
    for pack in packs:
        loss = packed_answer_loss(model, pack) / num_targets
        loss.backward()
        packed += float(loss.detach())
    assert packed == pytest.approx(float(padded.detach()), rel=1e-5)  # fp32 rounding of different reduction orders
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, padded_grads[n], rtol=1e-4, atol=1e-6)


def test_packed_bf16_sft_learns_and_saves_fp32_masters(tmp_path):
    from jetrl.models import load_model

    config = SFTConfig(output_dir=str(tmp_path / "m"), task="chain", difficulty=(1, 2), steps=20, batch_size=16,
                       hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                       intermediate_size=64, eval_examples=2, warmup_steps=4, log_every=4, lr=1e-2,
                       packing=True, micro_batch_tokens=256, dtype="bfloat16", checkpoint_every=0)
    assert config.uses_packing() and not SFTConfig().uses_packing()  # auto: packed on CUDA only
    result = run_sft(config, progress=False, log=lambda m: None)
    history = json.loads((tmp_path / "m" / "sft_metrics.json").read_text())["history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert losses[-1] < 0.8 * losses[0] and 0.0 <= result.accuracy <= 1.0
    assert all(h["grad_norm"] > 0 for h in history if "loss" in h)  # clipping sees the masters' gradients
    weights = _weights(tmp_path / "m")
    assert all(w.dtype == torch.float32 for w in weights.values())
    # the fp32 masters, not BF16 values: some weight has more mantissa bits than BF16 holds
    assert any(not torch.equal(w, w.bfloat16().float()) for w in weights.values())
    assert load_model(tmp_path / "m", dtype=torch.float32).config.hidden_size == 32
    with pytest.raises(ValueError, match="dtype"):
        SFTConfig(dtype="float16")
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        SFTConfig(micro_batch_tokens=0)


def test_sft_command_names_the_recipe_of_its_accuracy(tmp_path, capsys, monkeypatch):
    """... and writes ``--output-dir ~/m`` into the home folder, as the shell and the config loader read ``~``."""
    from jetrl.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    assert main(["sft", "--output-dir", "~/m", "--steps", "2", "--batch-size", "4", "--eval-examples",
                 "2", "--checkpoint-every", "0", "--no-progress"]) == 0
    assert "greedy accuracy (bf16, 2 unseen)" in capsys.readouterr().out
    assert (tmp_path / "m").is_dir() and not (tmp_path / "~").exists()


def test_a_saved_setting_since_removed_does_not_block_resume():
    """A checkpoint's saved config may hold a key that is no longer an SFTConfig field (task_options, before it
    became constants): it shaped nothing now read, so resume goes on; a changed field still stops it."""
    import dataclasses

    from jetrl.sft.train import _check_same_run

    config = SFTConfig(output_dir="out", **TINY)
    saved = {**json.loads(json.dumps(dataclasses.asdict(config))), "task_options": {}}
    _check_same_run(saved, config, "ckpt")
    with pytest.raises(ValueError, match=r"other settings \(lr: 0.02 -> 0.01\)"):
        _check_same_run({**saved, "lr": 0.02}, config, "ckpt")


def test_an_infinite_lr_is_refused_and_a_diverged_run_is_one_error_line(tmp_path, capsys):
    from jetrl.cli import main

    small = ["sft", "--output-dir", str(tmp_path / "m"), "--batch-size", "4", "--eval-examples", "2",
             "--checkpoint-every", "0", "--no-progress"]
    assert main([*small, "--steps", "2", "--lr", "inf"]) == 2
    assert "lr must be a finite number > 0" in capsys.readouterr().err
    assert main([*small, "--steps", "3", "--lr", "1e30"]) == 1  # the loss overflows: a run failure, no traceback
    err = capsys.readouterr().err
    assert "jetrl: error: sft: non-finite loss at step" in err and "Traceback" not in err
