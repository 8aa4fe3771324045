"""The RL loop's prompt adapter: what the policy is fed and what the reward function reads."""

import pytest
import torch

pytest.importorskip("transformers")

from jetrl.data import Prompt, PromptDataset, TemplateConfig  # noqa: E402
from jetrl.data.tasks.countdown import countdown_reward  # noqa: E402
from jetrl.rl.loop import DatasetPrompts  # noqa: E402
from jetrl.sft.tokenizer import BOS, EOS, build_char_tokenizer  # noqa: E402


def make_prompts(tokenizer, template=None):
    dataset = PromptDataset([Prompt(index=0, text="1,2>3", answer="1,2>3")], template=template)
    return DatasetPrompts(dataset, tokenizer, batch_size=1, seed=0, shuffle=False, max_prompt_tokens=64)


def test_plain_prompt_gets_the_tokenizer_bos_once():
    tokenizer = build_char_tokenizer()
    (item,) = make_prompts(tokenizer).next_batch()
    bos = tokenizer.convert_tokens_to_ids(BOS)
    assert item.ids[0] == bos and item.ids.count(bos) == 1
    assert tokenizer.decode(item.ids[1:]) == "1,2>3"


def test_chat_template_that_writes_bos_is_not_given_a_second_one():
    tokenizer = build_char_tokenizer()
    # a Llama-3-style template: the BOS token is part of the rendered text
    tokenizer.chat_template = BOS + "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (item,) = make_prompts(tokenizer, TemplateConfig(chat="always")).next_batch()
    bos = tokenizer.convert_tokens_to_ids(BOS)
    assert item.ids[0] == bos and item.ids.count(bos) == 1, item.ids


def test_decoded_completion_drops_the_final_eos_so_anchored_checkers_pass():
    tokenizer = build_char_tokenizer()
    prompts = make_prompts(tokenizer)
    ids = tokenizer.encode("#### 1+2", add_special_tokens=False) + [tokenizer.convert_tokens_to_ids(EOS)]
    text = prompts.decode(ids)
    assert text == "#### 1+2"
    assert countdown_reward(text, "1,2>3") == 1.0


def test_prompts_given_their_token_ids_batch_as_tokenized_ones(monkeypatch):
    """The ids check_prompt_lengths returned (jetrl train's check before the model loads) stand in for tokenizing
    each prompt again when a batch draws it: the same batches, in the same shuffled order, without a tokenization."""
    import jetrl.rl.loop as loop
    from jetrl.data import check_prompt_lengths

    tokenizer = build_char_tokenizer()
    dataset = PromptDataset([Prompt(index=i, text=f"{i}+{i}", answer=str(2 * i)) for i in range(5)])
    token_ids = check_prompt_lengths(dataset, tokenizer, 64)
    tokenized = DatasetPrompts(dataset, tokenizer, batch_size=3, seed=1, shuffle=True, max_prompt_tokens=64)
    want = [tokenized.next_batch() for _ in range(4)]
    monkeypatch.setattr(loop, "encode_prompt", lambda *args: pytest.fail("a prompt was tokenized again"))
    given = DatasetPrompts(dataset, tokenizer, batch_size=3, seed=1, shuffle=True, max_prompt_tokens=64,
                           token_ids=token_ids)
    got = [given.next_batch() for _ in range(4)]
    assert got == want and all(type(t) is int for batch in got for item in batch for t in item.ids)
    assert given.state_dict() == tokenized.state_dict()


# ------------------------------------------------------------------ reward failures reach the step's metrics

def _ids_reward(text: str, reference: str) -> float:
    """Fails on purpose: raises when the completion's first token id is odd, else returns it as a number
    (or 1e9 when the reference asks for an absurd reward)."""
    first = int(text.split(",")[0]) if text else 0
    if first % 2:
        raise ValueError(f"odd first token {first} " + "x" * 5000)
    return 1e9 if reference == "absurd" else float(first % 4)


def _toy_trainer(reward_fn, reference=""):
    from jetrl.config import load_config
    from jetrl.models import DecoderConfig, build_model
    from jetrl.rl.trainer import PromptItem, Trainer
    from jetrl.rollout import RolloutEngine

    class Prompts:
        def next_batch(self):
            return [PromptItem([2 + i, 3, 4], reference) for i in range(4)]

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

    cfg = load_config(None, ["--recipe=bf16", "--data.prompts_per_step=4", "--rollout.n=4", "--rollout.max_tokens=4",
                             "--algorithm.mini_batch_size=16", "--algorithm.micro_batch_size=16", "--trainer.steps=2"])
    model = build_model(DecoderConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=32, eos_token_id=1), dtype=torch.float32, seed=0)
    engine = RolloutEngine(model, max_num_seqs=16, num_blocks=64, block_size=4, progress=False)
    return Trainer(cfg, model, engine, Prompts(), reward_fn, lambda ids: ",".join(map(str, ids)))


def test_failed_rewards_are_counted_reported_once_and_stop_the_run_when_all_fail():
    from jetrl.data.reward_pool import RewardFailureError, RewardFailureGuard, RewardPool, RewardPoolConfig
    from jetrl.rl.loop import guarded_rewards

    lines, seen = [], []
    pool = RewardPool(_ids_reward, RewardPoolConfig(num_workers=0, max_abs_reward=100.0))
    guarded = guarded_rewards(pool, RewardFailureGuard(log=lines.append))

    def recording(texts, refs):
        seen.append(texts)
        return guarded(texts, refs)

    trainer = _toy_trainer(recording)
    m = trainer.step()
    num_odd = sum(int(t.split(",")[0]) % 2 for t in seen[0] if t)
    assert 0 < num_odd < 16 and m["reward/errors"] == num_odd and m["reward/timeouts"] == 0.0
    assert len(lines) == 1 and "ValueError: odd first token" in lines[0] and len(lines[0]) < 1200
    m = trainer.step()
    assert len(lines) == 1  # reported once per run

    absurd = _toy_trainer(guarded_rewards(pool, RewardFailureGuard(log=lines.append)), reference="absurd")
    with pytest.raises(RewardFailureError, match="failed for 16 of 16 samples"):
        absurd.step()  # every reward is either an error or beyond max_abs_reward


def test_the_reward_stop_rule_judges_the_whole_step_on_several_ranks():
    """Under data parallelism each rank scores its share; the stop rule (``reward.stop_fraction``) is about the
    step's samples, so every rank decides from the counts summed over ranks (here a second rank's, as the
    collective would return them): one rank whose every sample failed does not stop a step that mostly scored."""
    from jetrl.data.reward_pool import RewardFailureError, RewardFailureGuard, RewardPool, RewardPoolConfig
    from jetrl.rl.loop import guarded_rewards

    class TwoRanks:  # ParallelContext's face to the guard: a sum with the other rank's (errors, timeouts, samples)
        is_distributed = True

        def __init__(self, other):
            self.other = other

        def sum(self, values):
            return [float(v + o) for v, o in zip(values, self.other)]

    pool = RewardPool(_ids_reward, RewardPoolConfig(num_workers=0))
    texts = ["1,2", "3,4", "5,6", "7,8"]  # odd first tokens: every sample of this rank fails
    lines = []
    with pytest.raises(RewardFailureError, match="failed for 4 of 4 samples"):
        guarded_rewards(pool, RewardFailureGuard(log=lines.append))(texts, ["r"] * 4)
    result = guarded_rewards(pool, RewardFailureGuard(log=lines.append), TwoRanks((0, 0, 4)))(texts, ["r"] * 4)
    assert result.num_errors == 4 and "failed for 4 of 8 samples" in lines[-1]
    with pytest.raises(RewardFailureError, match="failed for 8 of 8 samples"):
        guarded_rewards(pool, RewardFailureGuard(), TwoRanks((3, 1, 4)))(texts, ["r"] * 4)
