"""The byte-level tokenizer of the tiny presets, built locally with no download.

Token id `b` (0-255) is the raw byte `b`, so any text encodes and decodes back exactly; three
special tokens follow: `<|endoftext|>` (256, padding), `<|im_start|>` (257) and `<|im_end|>` (258,
the end of a turn and so the EOS). The chat template is ChatML:
`<|im_start|>role\\ncontent<|im_end|>\\n` per message and `<|im_start|>assistant\\n` as the
generation prompt.
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """The ChatML byte tokenizer: `BYTE_VOCAB_SIZE` tokens, EOS `<|im_end|>`, pad `<|endoftext|>`."""
    byte_to_char = bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        chat_template=CHATML_TEMPLATE,
    )
