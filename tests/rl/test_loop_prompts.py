"""The RL loop's prompt adapter: what the policy is fed and what the reward function reads."""

import pytest

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
