"""`radixkv export`: a preset written as a Hugging Face folder that transformers loads as it is,
and that radixkv serves with the preset's own greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixkv import Engine, EngineConfig, SamplingParams
from radixkv.cli import main
from radixkv.model.loader import load_model

PROMPT = list(b"<|im_start|>user\nhello")


@pytest.mark.slow  # the 4-layer preset through two engines and transformers: about 14 s here
def test_export_writes_a_folder_transformers_and_radixkv_load(tmp_path):
    folder = tmp_path / "tiny"
    assert main(["export", "tiny-llama", str(folder), "--dtype", "float32"]) == 0
    assert "chat_template" in json.loads((folder / "tokenizer_config.json").read_text())  # for any version
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.encode("hé", add_special_tokens=False) == list(
        "hé".encode()
    )
    preset = load_model("tiny-llama", dtype="float32", device="cpu").model
    for name, weight in preset.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], weight, rtol=0, atol=0)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = Engine(EngineConfig(model="tiny-llama", dtype="float32", kv_cache_memory="8MiB")).generate(
        PROMPT, params
    )[0]
    got = Engine.from_pretrained(folder, kv_cache_memory="8MiB").generate(PROMPT, params)[0]
    assert got.token_ids == want.token_ids
    with torch.no_grad():
        hf = model.generate(torch.tensor([PROMPT]), do_sample=False, max_new_tokens=8, min_new_tokens=8)
    assert hf[0, len(PROMPT) :].tolist() == want.token_ids


def test_export_refuses_a_folder_that_holds_a_model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert main(["export", "tiny-llama", str(tmp_path)]) == 2
    with pytest.raises(ValueError, match="already holds a model"):
        from radixkv.tools.export import export_model

        export_model("tiny-llama", tmp_path)
