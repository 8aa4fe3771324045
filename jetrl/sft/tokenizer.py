"""A character-level tokenizer over the compact task alphabet, saved as HuggingFace tokenizer files.

The embedded model reads and writes the built-in tasks' compact format (``12+7-3*2\\n`` ...), whose
characters are :data:`jetrl.data.tasks.COMPACT_ALPHABET`: one token per character makes every digit of a
chain of thought a separate decision, which is what RL then shapes. Special tokens: ``<pad>`` (0), ``<bos>``
(1, prepended on encode), ``<eos>`` (2, the end of every worked solution) and ``<unk>`` (3). Saved with
``transformers.PreTrainedTokenizerFast``, so ``transformers.AutoTokenizer`` loads it too; decoding leaves
the text exactly as generated.
"""

from __future__ import annotations

import json
import os

from jetrl.data.tasks import COMPACT_ALPHABET

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)


def build_char_tokenizer(alphabet: str = COMPACT_ALPHABET):
    """A ``transformers.PreTrainedTokenizerFast``: special tokens first, then one id per character of
    ``alphabet`` (in the given order); ``<bos>`` is prepended on encode."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))
    if not chars:
        raise ValueError("the tokenizer alphabet is empty")
    vocab = {tok: i for i, tok in enumerate((*SPECIAL_TOKENS, *chars))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # every character (newline included) is its own pre-token
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B",
                                                       special_tokens=[(BOS, vocab[BOS])])
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, clean_up_tokenization_spaces=False,
                                   model_max_length=4096)


def save_char_tokenizer(folder: str | os.PathLike, alphabet: str = COMPACT_ALPHABET):
    """Build the character tokenizer and write tokenizer.json, tokenizer_config.json and
    special_tokens_map.json into ``folder``; returns the tokenizer."""
    tokenizer = build_char_tokenizer(alphabet)
    os.makedirs(folder, exist_ok=True)
    tokenizer.save_pretrained(os.fspath(folder))
    special_map = os.path.join(folder, "special_tokens_map.json")
    if not os.path.exists(special_map):  # transformers >= 5 keeps these in tokenizer_config.json only
        with open(special_map, "w") as f:
            json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}, f, indent=2)
    return tokenizer


__all__ = ["build_char_tokenizer", "save_char_tokenizer", "SPECIAL_TOKENS", "PAD", "BOS", "EOS", "UNK"]
