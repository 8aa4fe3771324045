"""pass@k estimator values and evaluation of the embedded model (in the weak-but-not-hopeless band)."""

import math

import pytest
import torch

from jetrl.evaluate import evaluate, pass_at_k


def test_pass_at_k_hand_values():
    assert pass_at_k(4, 0, 1) == 0.0 and pass_at_k(4, 4, 4) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(4, 2))  # 0.5
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - math.comb(3, 3) / math.comb(5, 3))  # 0.9
    assert pass_at_k(3, 1, 3) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


@pytest.fixture(scope="module")
def tiny():
    from jetrl.asset_files import EMBEDDED_MODEL, resolve_asset
    from jetrl.models import load_model, load_tokenizer

    path = resolve_asset(EMBEDDED_MODEL)
    return load_model(path, dtype=torch.float32), load_tokenizer(path)


def test_embedded_model_is_weak_but_not_hopeless(tiny):
    """Greedy accuracy on 100 unseen problems (a fixed eval seed) lies well inside (0, 1): RL has room."""
    from jetrl.data.tasks import get_task

    model, tok = tiny
    data = get_task("arithmetic", difficulty=3, seed=12345).dataset(100)
    result = evaluate(model, tok, data, max_tokens=64, reward_workers=0)
    assert 0.10 <= result.accuracy <= 0.70, result.accuracy
    assert result.pass_at_k[1] == pytest.approx(result.accuracy)
    assert result.truncation_rate < 0.2  # it has learned to stop


def test_sampled_pass_at_k_is_monotone(tiny):
    from jetrl.data.tasks import get_task

    model, tok = tiny
    data = get_task("arithmetic", difficulty=3, seed=777).dataset(16)
    result = evaluate(model, tok, data, n=4, temperature=1.0, ks=(1, 2, 4), max_tokens=64, reward_workers=0,
                      keep_samples=True)
    p = result.pass_at_k
    assert p[1] == pytest.approx(result.accuracy)
    assert p[1] <= p[2] <= p[4] and p[4] > 0
    assert len(result.samples) == 64 and {s["reward"] for s in result.samples} <= {0.0, 1.0}


def test_greedy_with_several_samples_is_an_error(tiny):
    from jetrl.data.tasks import get_task

    model, tok = tiny
    with pytest.raises(ValueError, match="greedy"):
        evaluate(model, tok, get_task("arithmetic", seed=1).dataset(2), n=4, temperature=0.0)


def test_bad_k_and_a_late_long_prompt_stop_before_any_generation(tiny, monkeypatch):
    """pass@0 and a prompt past the context in the last batch are errors before the first batch is generated (were:
    found after generating the batches before them)."""
    from jetrl.data import Prompt, PromptDataset
    from jetrl.rollout import RolloutEngine

    model, tok = tiny
    monkeypatch.setattr(RolloutEngine, "generate", lambda *args, **kwargs: pytest.fail("generated"))
    with pytest.raises(ValueError, match=r"pass@k needs k >= 1, got k=0"):
        evaluate(model, tok, PromptDataset([Prompt(index=0, answer="1", text="1+0")], reward="arithmetic"), n=2,
                 temperature=1.0, ks=(0, 2))
    rows = [Prompt(index=i, answer="1", text="1+0") for i in range(9)] + [Prompt(index=9, answer="1", text="1+0" * 400)]
    with pytest.raises(ValueError, match=r"^prompt 9 has \d+ tokens"):
        evaluate(model, tok, PromptDataset(rows, reward="arithmetic"), batch_size=4, max_tokens=16)


def test_held_out_accuracy_refuses_training_problems_and_files():
    from jetrl.config import RunConfig, load_config
    from jetrl.evaluate import EVAL_SEED, held_out_accuracy

    config = load_config(None, ["--data.task=arithmetic", f"--trainer.seed={EVAL_SEED}"])
    with pytest.raises(ValueError, match="equals trainer.seed"):
        held_out_accuracy("unused", config, 8)
    with pytest.raises(ValueError, match="needs held-out prompts"):
        held_out_accuracy("unused", RunConfig(), 8)


def test_held_out_accuracy_on_a_held_out_file(tiny, tmp_path):
    """A run on a dataset file is evaluated on ``data.eval_path``'s first rows, read in the run's format: the same
    accuracy as ``evaluate`` on those rows (here the embedded model on arithmetic rows in a GSM8K-format file)."""
    import json

    from jetrl.asset_files import EMBEDDED_MODEL, resolve_asset
    from jetrl.config import DataConfig, ConfigError, load_config
    from jetrl.data import build_prompt_dataset
    from jetrl.data.tasks import get_task
    from jetrl.evaluate import held_out_accuracy

    problems = get_task("arithmetic", difficulty=3, seed=4242, style="compact").dataset(12)
    rows = [{"question": p.text, "answer": f"#### {p.answer}"} for p in problems]
    path = tmp_path / "held_out.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + [{"question": "1+1", "answer": "#### 2"}] * 5))
    config = load_config(None, [f"--data.path={tmp_path / 'train.jsonl'}", "--data.format=gsm8k",
                                "--data.instruction={prompt}",  # the compact model's prompts
                                f"--data.eval_path={path}",
                                "--model.dtype=float32", "--model.device=cpu", "--rollout.max_tokens=64"])
    got = held_out_accuracy(str(resolve_asset(EMBEDDED_MODEL)), config, 12)
    model, tok = tiny
    held_out = DataConfig(path=str(path), format="gsm8k", instruction="{prompt}", max_examples=12)
    want = evaluate(model, tok, build_prompt_dataset(held_out, 0), max_tokens=64).accuracy
    assert got == want and 0.0 < got < 1.0
    with pytest.raises(ConfigError, match="data.eval_path .* is for a run on a file"):
        load_config(None, ["--data.task=arithmetic", f"--data.eval_path={path}"])


def test_generate_texts_greedy_completions(tiny):
    from jetrl.evaluate import generate_texts

    model, tok = tiny
    outs = generate_texts(model, tok, ["12+7-3*2", "3+4*2\n"], max_tokens=48)
    assert [len(o) for o in outs] == [1, 1] and all("####" in o[0] for o in outs)
    assert generate_texts(model, tok, ["12+7-3*2"], max_tokens=48) == outs[:1]  # greedy: deterministic
