"""Prompt rendering: the tokenizer's chat template when it has one, else the plain template."""

from __future__ import annotations

import pytest

from jetrl.data import Prompt, TemplateConfig, has_chat_template, render_prompt


class ChatTokenizer:
    """Stands in for a HF tokenizer with a chat template: records what it was asked to render."""

    chat_template = "{% for m in messages %}...{% endfor %}"

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, tokenize=True, add_generation_prompt=False):
        self.calls.append((messages, tokenize, add_generation_prompt))
        body = "".join(f"<|{m['role']}|>{m['content']}<|end|>" for m in messages)
        return body + ("<|assistant|>" if add_generation_prompt else "")


class BaseTokenizer(ChatTokenizer):
    chat_template = None


PROBLEM = Prompt(index=0, text="Find $\\frac{a}{b}$ when {a}=1.", answer="1")


def test_chat_template_used_when_present():
    tok = ChatTokenizer()
    config = TemplateConfig(instruction="{prompt}\nAnswer after ####.", system_prompt="You are precise.")
    text = render_prompt(PROBLEM, tok, config)
    assert tok.calls == [(
        [{"role": "system", "content": "You are precise."},
         {"role": "user", "content": PROBLEM.text + "\nAnswer after ####."}],
        False,
        True,
    )]
    assert text == ("<|system|>You are precise.<|end|><|user|>" + PROBLEM.text + "\nAnswer after ####.<|end|>"
                    "<|assistant|>")


def test_plain_template_without_chat_template():
    config = TemplateConfig(instruction="{prompt} Think.", plain_template="Q: {prompt}\nA:")
    assert not has_chat_template(BaseTokenizer()) and not has_chat_template(None)
    # LaTeX braces and a literal "{a}" in the problem survive (no str.format on user text).
    assert render_prompt(PROBLEM, BaseTokenizer(), config) == "Q: " + PROBLEM.text + " Think.\nA:"
    assert render_prompt(PROBLEM, None, config) == "Q: " + PROBLEM.text + " Think.\nA:"
    with_system = TemplateConfig(system_prompt="Be exact.")
    assert render_prompt(PROBLEM, None, with_system) == "Be exact.\n\n" + PROBLEM.text
    # chat='never' ignores a chat template
    assert render_prompt(PROBLEM, ChatTokenizer(), TemplateConfig(chat="never")) == PROBLEM.text


def test_conversation_prompts():
    conv = Prompt(index=1, messages=({"role": "user", "content": "Hi {prompt}"},), answer="x")
    tok = ChatTokenizer()
    assert render_prompt(conv, tok) == "<|user|>Hi {prompt}<|end|><|assistant|>"
    assert render_prompt(conv, None) == "user: Hi {prompt}\nassistant:"


def test_template_errors():
    with pytest.raises(ValueError, match="has no chat template"):
        render_prompt(PROBLEM, BaseTokenizer(), TemplateConfig(chat="always"))
    with pytest.raises(ValueError, match="must be a string containing '{prompt}'"):
        TemplateConfig(instruction="no placeholder")
    with pytest.raises(ValueError, match="chat must be"):
        TemplateConfig(chat="sometimes")
