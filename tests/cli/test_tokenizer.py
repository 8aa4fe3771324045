"""The character tokenizer: one id per character of the compact alphabet, BOS prepended, HF loadable."""

import pytest

from jetrl.data.tasks import COMPACT_ALPHABET, get_task
from jetrl.sft.tokenizer import SPECIAL_TOKENS, save_char_tokenizer


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    save_char_tokenizer(path)
    return path


def test_files_and_loaders(folder):
    from transformers import AutoTokenizer

    from jetrl.models import load_tokenizer

    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {p.name for p in folder.iterdir()}
    for tok in (AutoTokenizer.from_pretrained(folder), load_tokenizer(folder)):
        assert len(tok) == len(SPECIAL_TOKENS) + len(COMPACT_ALPHABET)
        assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
        assert tok.chat_template is None  # prompts render with the plain template


def test_every_task_text_round_trips_one_id_per_character(folder):
    from jetrl.models import load_tokenizer

    tok = load_tokenizer(folder)
    for name in ("arithmetic", "countdown"):
        for ex in get_task(name, difficulty=(1, 6), seed=3).examples(50):
            text = ex.prompt + ex.solution
            ids = tok.encode(text)
            assert ids[0] == tok.bos_token_id and len(ids) == len(text) + 1
            assert tok.unk_token_id not in ids
            assert tok.decode(ids, skip_special_tokens=True) == text  # spaces, commas, newlines kept as is


def test_unknown_character_maps_to_unk(folder):
    from jetrl.models import load_tokenizer

    tok = load_tokenizer(folder)
    ids = tok.encode("1+x", add_special_tokens=False)
    assert ids[2] == tok.unk_token_id and len(ids) == 3
