"""The byte tokenizer: exact text round trips, one id per special token, ChatML rendering."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from radixkv.model.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer


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
