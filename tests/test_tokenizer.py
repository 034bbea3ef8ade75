"""The byte tokenizer: exact text round trips, one id per special token, ChatML rendering; and
the front end's decode, which must be the tokenizer's own."""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from radixkv.engine.input_processor import InputProcessor
from radixkv.model.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer
from radixkv.model.tokenizer_threads import PerThreadTokenizer


def test_text_round_trips_byte_for_byte() -> None:
    tokenizer = build_byte_tokenizer()
    for text in ["Hello, world!", "  leading spaces\n\ttabs\r\n", "héllo wörld 你好 🙂", ""]:
        ids = tokenizer.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tokenizer.decode(ids) == text


def test_special_tokens_are_single_ids_and_eos_is_im_end() -> None:
    tokenizer = build_byte_tokenizer()
    assert len(tokenizer) == BYTE_VOCAB_SIZE == 259
    assert tokenizer.encode("<|im_start|>a<|im_end|>") == [257, 97, 258]
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == 258
    assert tokenizer.decode([257, 104, 258], skip_special_tokens=True) == "h"


def test_chat_template_renders_chatml() -> None:
    tokenizer = build_byte_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == expected + "<|im_start|>assistant\n"


def test_saved_tokenizer_loads_back_locally(tmp_path: Path) -> None:
    tokenizer = build_byte_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    text = "<|im_start|>user\nçà<|im_end|>\n"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert loaded.chat_template == tokenizer.chat_template
    assert loaded.eos_token_id == 258


def test_the_front_ends_decode_is_the_tokenizers_own() -> None:
    """`InputProcessor.decode` goes to a fast tokenizer's Rust backend directly: the text must be
    `decode`'s for any ids (specials skipped, a character cut mid-bytes), through the per-thread
    wrapper the server uses too."""
    tokenizer = build_byte_tokenizer()
    rng = random.Random(0)
    for wrapped in (tokenizer, PerThreadTokenizer(tokenizer)):
        inputs = InputProcessor(wrapped, BYTE_VOCAB_SIZE, 64, 1, 8, 4)
        assert inputs._backend_decodes  # else this checks transformers against itself
        for _ in range(300):
            ids = [rng.randrange(BYTE_VOCAB_SIZE) for _ in range(rng.randrange(0, 12))]
            assert inputs.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_is_decoded_by_transformers() -> None:
    """The backend alone does not clean up spaces before punctuation; `decode` does, when the
    tokenizer asks for it, and so must the front end."""
    backend = Tokenizer(models.WordLevel({"hello": 0, ".": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=True)
    assert backend.decode([0, 1]) == "hello ."
    assert InputProcessor(tokenizer, 3, 64, 1, 8, 4).decode([0, 1]) == tokenizer.decode([0, 1]) == "hello."
