"""Turning a :class:`Prompt` into the exact string the policy sees.

When the tokenizer carries a chat template (instruction-tuned checkpoints), the prompt becomes a user turn
(after an optional system turn) rendered by ``tokenizer.apply_chat_template(..., add_generation_prompt=True)``,
so the model is prompted the way it was trained. Otherwise (base checkpoints, the embedded character-level
model) the plain template ``plain_template`` is filled in. The instruction wrapper (``"{prompt}\\nPut the final
answer after ####."``) applies to a text prompt in both cases; a prompt given as chat turns keeps its turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from jetrl.data.prompt import Prompt

ChatMode = Literal["auto", "always", "never"]
CHAT_MODES: tuple[str, ...] = get_args(ChatMode)


@dataclass
class TemplateConfig:
    """How prompts are rendered.

    ``instruction`` wraps the problem text (must contain ``{prompt}``); ``plain_template`` is the whole
    string for tokenizers without a chat template (must contain ``{prompt}``, may contain ``{system}``);
    ``chat`` is ``"auto"`` (chat template when the tokenizer has one), ``"always"`` (error if it has none)
    or ``"never"``.
    """

    instruction: str = "{prompt}"
    system_prompt: str | None = None
    plain_template: str = "{prompt}"
    chat: ChatMode = "auto"

    def __post_init__(self) -> None:
        for name in ("instruction", "plain_template"):
            value = getattr(self, name)
            if not isinstance(value, str) or "{prompt}" not in value:
                raise ValueError(f"TemplateConfig.{name} must be a string containing '{{prompt}}', got {value!r}")
        if self.chat not in CHAT_MODES:
            raise ValueError(f"TemplateConfig.chat must be one of {', '.join(map(repr, CHAT_MODES))}, "
                             f"got {self.chat!r}")


def has_chat_template(tokenizer: Any) -> bool:
    """True when ``tokenizer`` can render chat turns (a HF tokenizer with a non-empty ``chat_template``)."""
    return bool(getattr(tokenizer, "chat_template", None)) and callable(getattr(tokenizer, "apply_chat_template", None))


def prompt_messages(prompt: Prompt, config: TemplateConfig) -> list[dict[str, str]]:
    """The chat turns for ``prompt``: the system prompt (if any) then the instruction-wrapped user turn.
    A prompt that already is a conversation keeps its turns (the system prompt is added if it has none)."""
    if prompt.messages is not None:
        turns = [dict(t) for t in prompt.messages]
    else:
        turns = [{"role": "user", "content": _fill(config.instruction, prompt=prompt.text)}]
    if config.system_prompt and not any(t["role"] == "system" for t in turns):
        turns.insert(0, {"role": "system", "content": config.system_prompt})
    return turns


def render_prompt(prompt: Prompt, tokenizer: Any = None, config: TemplateConfig | None = None) -> str:
    """The text fed to the policy for ``prompt`` (tokenize it with :func:`encode_prompt`, which adds no second
    BOS where a chat template already wrote one)."""
    config = config or TemplateConfig()
    if config.chat == "always" or (config.chat == "auto" and has_chat_template(tokenizer)):
        if not has_chat_template(tokenizer):
            raise ValueError("TemplateConfig.chat='always' but the tokenizer has no chat template; set chat='auto' or "
                             "'never' to use the plain template, or load a tokenizer with a chat_template")
        messages = prompt_messages(prompt, config)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if prompt.messages is not None:  # a conversation without a chat template: plain "role: content" lines
        return "\n".join(f"{t['role']}: {t['content']}" for t in prompt_messages(prompt, config)) + "\nassistant:"
    body = _fill(config.instruction, prompt=prompt.text)
    # {prompt} last, so that the problem's own text is never scanned for placeholders
    text = _fill(config.plain_template, system=config.system_prompt or "", prompt=body)
    if config.system_prompt and "{system}" not in config.plain_template:
        text = f"{config.system_prompt}\n\n{text}"
    return text


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered prompt. The tokenizer adds its special tokens (its BOS) unless the text
    already starts with the BOS token, as chat templates write it (Llama 3): never two BOS tokens.
    ``tokenizer`` is a ``transformers`` tokenizer (what :func:`jetrl.models.load_tokenizer` returns), whose
    ``encode`` gives the list of ids."""
    bos = getattr(tokenizer, "bos_token", None)
    starts_with_bos = isinstance(bos, str) and bos and text.startswith(bos)
    ids = tokenizer.encode(text, add_special_tokens=False) if starts_with_bos else tokenizer.encode(text)
    if not isinstance(ids, list):  # e.g. a raw ``tokenizers.Tokenizer``, whose encode gives an Encoding
        raise TypeError(f"encode_prompt needs a transformers tokenizer (jetrl.models.load_tokenizer), whose encode "
                        f"returns a list of ids; {type(tokenizer).__name__}.encode returned {type(ids).__name__}")
    return ids


def decode_completion(tokenizer: Any, ids: Sequence[int]) -> str:
    """Completion text for the reward function, without special tokens: the end-of-sequence token the
    rollout keeps as the last token must not reach answer checkers anchored at the end of the text."""
    try:
        return tokenizer.decode(list(ids), skip_special_tokens=True)
    except TypeError:  # a decoder without the keyword
        return tokenizer.decode(list(ids))


def _fill(template: str, **values: str) -> str:
    """``str.format`` that leaves other braces alone (LaTeX problems are full of ``{}``)."""
    for key, value in values.items():
        template = template.replace("{" + key + "}", value)
    return template
