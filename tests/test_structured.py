"""Structured output below the server: the batched bitmask in the sampler against a plain-torch
masked argmax, the masks llguidance fills against the grammar's own language, and the engine's
structured requests (forks, finishing when the grammar is complete, bad specs refused)."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch

import radixkv.scheduler.step_sampling as step_sampling
from radixkv import Engine
from radixkv.errors import RequestError
from radixkv.model.tokenizer import BYTE_VOCAB_SIZE, build_byte_tokenizer
from radixkv.sampling.logits_processors import TokenMask
from radixkv.sampling.sampler import make_generator, sample
from radixkv.sampling_params import SamplingParams
from radixkv.structured import StructuredOutputs
from radixkv.structured.grammar import GrammarCompiler
from radixkv.structured.masks import MaskFiller

EOS = 258


def pack(allowed: list[set[int]], vocab: int) -> torch.Tensor:
    """The int32 bitmask of `allowed`, packed one bit at a time."""
    words = (vocab + 31) // 32
    rows = []
    for tokens in allowed:
        row = [0] * words
        for t in tokens:
            row[t // 32] |= 1 << (t % 32)
        rows.append([w - (1 << 32) if w >= 1 << 31 else w for w in row])  # as int32 holds it
    return torch.tensor(rows, dtype=torch.int32)


def unpack(bitmask: torch.Tensor, vocab: int) -> list[set[int]]:
    return [{t for t in range(vocab) if (int(row[t // 32]) >> (t % 32)) & 1} for row in bitmask]


def test_sampler_with_a_bitmask_never_picks_a_masked_token():
    vocab, rows = 259, 6
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    before = logits.clone()
    allowed: list[set[int] | None] = [
        set(torch.randperm(vocab, generator=gen)[:k].tolist()) for k in (1, 2, 7, 40, 200)
    ] + [None]
    masked = [i for i, a in enumerate(allowed) if a is not None]  # the last row is free: not in the mask
    mask = TokenMask(masked, pack([allowed[i] for i in masked], vocab))
    keep = torch.tensor([[a is None or t in a for t in range(vocab)] for a in allowed])
    want = logits.masked_fill(~keep, float("-inf")).argmax(dim=-1)
    greedy = [SamplingParams(temperature=0)] * rows
    assert torch.equal(sample(logits, greedy, [None] * rows, mask=mask), want)
    hot = [SamplingParams(temperature=2.0, top_k=3)] * rows
    for seed in range(50):
        gens = [make_generator(seed * rows + i, "cpu") for i in range(rows)]
        tokens = sample(logits, hot, gens, mask=mask).tolist()
        for token, row, a in zip(tokens, logits, allowed, strict=True):
            assert a is None or token in a
            top3 = set(
                row.masked_fill(
                    torch.tensor([a is not None and t not in a for t in range(vocab)]), float("-inf")
                )
                .topk(3)
                .indices.tolist()
            )
            assert token in top3  # top-k runs over the allowed tokens only
    assert torch.equal(logits, before)  # the caller's logits (the logprobs' source) untouched


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(build_byte_tokenizer(), BYTE_VOCAB_SIZE, [EOS])


def test_masks_allow_exactly_the_grammars_next_bytes_and_eos_only_at_its_end(compiler):
    filler = MaskFiller(BYTE_VOCAB_SIZE)
    digits = compiler.matcher(StructuredOutputs(regex="[0-9]+"))
    word = compiler.matcher(StructuredOutputs(choice=("ab", "ac")))
    filler.start([digits, word])
    first = unpack(filler.rows([digits, word]), BYTE_VOCAB_SIZE)
    assert first == [set(range(ord("0"), ord("9") + 1)), {ord("a")}]
    assert digits.consume_token(ord("7")) and word.consume_token(ord("a"))
    filler.start([digits, word])
    second = unpack(filler.rows([word, digits]), BYTE_VOCAB_SIZE)  # rows come back in the order asked
    assert second == [{ord("b"), ord("c")}, set(range(ord("0"), ord("9") + 1)) | {EOS}]
    filler.close()


def test_a_spec_compiles_once_and_bad_specs_name_the_field(compiler):
    spec = StructuredOutputs(json='{"type": "integer"}')
    a, b = compiler.matcher(spec), compiler.matcher(spec)
    assert a is not b and a.consume_token(ord("4")) and b.consume_token(ord("5"))  # separate states
    for bad in (
        StructuredOutputs(regex="a("),
        StructuredOutputs(json='{"type": "nope"}'),
        StructuredOutputs(grammar="start: missing"),
    ):
        with pytest.raises(ValueError, match="structured_outputs"):
            compiler.check(bad)
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=StructuredOutputs(regex="a", choice=("b",)))


def test_engine_samples_follow_the_grammar_and_finish_when_it_is_complete(small_llama_engine: Engine):
    schema = {
        "type": "object",
        "properties": {"k": {"enum": ["x", "yz"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["k", "n"],
        "additionalProperties": False,
    }
    engine = small_llama_engine
    json_spec = StructuredOutputs(json=json.dumps(schema))
    ids = [  # one batch: the forks of one and the other's single sequence sample together
        engine.add_request("a", SamplingParams(max_tokens=40, n=3, seed=1, structured_outputs=json_spec)),
        engine.add_request(
            "b",
            SamplingParams(
                max_tokens=40, temperature=0, structured_outputs=StructuredOutputs(regex="q[rs]{2}")
            ),
        ),
    ]
    engine.run_until(lambda: all(engine.is_finished(i) for i in ids))
    outs = [engine.output(i) for i in ids]
    for sample_ in outs[0].samples:
        value = json.loads(sample_.text)
        assert sample_.finish_reason == "stop" and value["k"] in ("x", "yz") and 0 <= value["n"] <= 9
    (regex,) = outs[1].samples
    assert re.fullmatch("q[rs]{2}", regex.text) and regex.finish_reason == "stop"
    assert len(regex.token_ids) == 3  # done at the grammar's end: no EOS drawn, no token past it
    with pytest.raises(ValueError, match="structured_outputs"):
        small_llama_engine.generate("a", SamplingParams(structured_outputs=StructuredOutputs(regex="(")))


def test_a_token_its_grammar_rejects_fails_that_request_alone(model_folders, monkeypatch):
    """Fault injection: the sampler hands a structured row a token its mask forbids. That request
    fails; its neighbour in the same steps finishes as it would alone, and nothing leaks."""
    real = step_sampling.sample

    def poisoned(logits, params, generators, *rest):
        tokens = real(logits, params, generators, *rest)
        for i, p in enumerate(params):
            if p.structured_outputs is not None:
                tokens[i] = ord("z")  # the grammar takes digits only
        return tokens

    monkeypatch.setattr(step_sampling, "sample", poisoned)
    engine = Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="8MiB")
    greedy = SamplingParams(max_tokens=6, temperature=0)
    alone = engine.generate("neighbour", greedy)[0].token_ids
    bad = engine.add_request(
        "x", SamplingParams(max_tokens=6, structured_outputs=StructuredOutputs(regex="[0-9]+"))
    )
    good = engine.add_request("neighbour", greedy)
    engine.run_until(lambda: engine.is_finished(bad) and engine.is_finished(good))
    with pytest.raises(RequestError) as raised:
        engine.output(bad)
    assert "rejected token" in str(raised.value.__cause__)
    assert engine.output(good).token_ids == alone
    engine.check_invariants()
    assert engine.kv.num_live_tables() == 0


def test_closing_an_engine_stops_its_mask_worker(model_folders):
    """A structured request starts the mask worker thread; `close()` stops it."""

    def mask_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("radixkv-grammar-masks")}

    # This engine's own thread, not a count: an earlier test's engine, collected meanwhile, may
    # stop its worker at any moment.
    before = mask_threads()
    engine = Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="8MiB")
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(regex="[0-9]+"))
    assert engine.generate("x", params)[0].finish_reason in ("stop", "length")
    (ours,) = mask_threads() - before
    engine.close()
    ours.join(30)
    assert not ours.is_alive(), "the mask worker outlived its engine's close()"
