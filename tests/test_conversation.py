import pytest

from radixkv.conversation import Conversation
from radixkv.model.tokenizer import build_byte_tokenizer


def test_each_text_prompt_extends_the_last_prompt_and_reply_exactly():
    tok = build_byte_tokenizer()
    conv = Conversation(tok, "Be terse.")
    first = conv.prompt("Hi!")
    assert tok.decode(first) == tok.apply_chat_template(
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi!"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    reply = [0xE2, 0x82, 0xFF, 65]  # not valid UTF-8: a decode/encode round trip would change it
    conv.add_reply(reply, tok.decode(reply))
    second = conv.prompt("More")
    assert second[: len(first) + len(reply)] == first + reply
    assert tok.decode(second[len(first) + len(reply) :]).startswith("<|im_end|>\n<|im_start|>user\nMore")
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant"]


def test_id_conversations_concatenate():
    conv = Conversation(None, [9, 9])
    assert conv.prompt([1, 2]) == [9, 9, 1, 2]
    conv.add_reply([3])
    assert conv.prompt([4]) == [9, 9, 1, 2, 3, 4]


def test_an_unanswered_prompt_leaves_the_conversation_unchanged():
    conv = Conversation(None)
    conv.prompt([1, 2])
    assert conv.prompt([5]) == [5]  # the first message was never answered
    with pytest.raises(ValueError, match="token ids"):
        conv.prompt("hello")


def test_text_system_prompt_needs_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        Conversation(None, "You are terse.")
