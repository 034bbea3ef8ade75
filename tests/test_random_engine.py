"""Seeded random runs of the whole engine: submit, abort, step and inject failures on a pool just
larger than the largest request, with `check_invariants()` after every step.

The model is a stand-in (`EchoRunner`) so that 2,000 operations run in seconds: its "KV" is the
token and position written at each slot, and the logits of a row are a fixed pseudo-random
function of the whole sequence read back through the block table. Any wrong KV (a copy not
made, a block shared too early, uncomputed slots served from the cache) reads back a different
sequence and so changes the tokens. Completed greedy requests must equal that function applied
to the true sequence (a pure-Python oracle); beams and seeded samples must equal a roomy pool's.
Each run goes once with host/device overlap (`EngineConfig.overlap`: the stand-in's forward runs
on the step worker while the next step is scheduled) and once without.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
import torch
from random_runs import run_length

from radixkv import BeamSearchParams, Engine, RequestError, SamplingParams
from radixkv.scheduler.chunk import SequenceChunk

BLOCK = 4
VOCAB = 259


class Fault(RuntimeError):
    pass


def logits_for(tokens: np.ndarray) -> torch.Tensor:
    seed = zlib.crc32(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def greedy_oracle(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(int(logits_for(np.array(seq)).argmax()))
    return seq[len(prompt) :]


class EchoRunner:
    def __init__(self, num_blocks: int) -> None:
        self.slots = np.full((num_blocks, BLOCK, 2), -1, dtype=np.int64)  # (token, position)
        self.device = torch.device("cpu")
        self.fail_next = False

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.slots[dst] = self.slots[src]

    def forward(self, chunks: list[SequenceChunk]) -> torch.Tensor:
        if self.fail_next:
            self.fail_next = False
            raise Fault("injected")
        rows = []
        for c in chunks:
            for j, token in enumerate(c.token_ids):
                p = c.start_pos + j
                self.slots[c.block_table[p // BLOCK], p % BLOCK] = (token, p)
            if c.logits == "last":
                pos = np.arange(c.start_pos + len(c.token_ids))
                kv = self.slots[np.asarray(c.block_table)[pos // BLOCK], pos % BLOCK]
                tokens = np.where(kv[:, 1] == pos, kv[:, 0], -1)  # a slot of another position reads as -1
                rows.append(logits_for(tokens))
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)


def make_engine(folder, kv_cache_memory: str | int, overlap: bool = False) -> Engine:
    engine = Engine.from_pretrained(
        folder,
        block_size=BLOCK,
        kv_cache_memory=kv_cache_memory,
        max_num_batched_tokens=16,
        max_num_seqs=6,
        overlap=overlap,
    )
    engine.runner = EchoRunner(engine.pool.num_blocks)
    return engine


def random_request(rng: random.Random, docs: list[list[int]]):
    doc = rng.choice(docs)
    prompt = doc[: rng.randrange(1, len(doc))] + [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
    prompt = prompt[:24]
    kind = rng.random()
    if kind < 0.15:
        return prompt, BeamSearchParams(beam_width=2, max_tokens=rng.randrange(1, 10), ignore_eos=True)
    if kind < 0.35:
        seed = rng.randrange(99)
        return prompt, SamplingParams(max_tokens=rng.randrange(1, 12), temperature=1.0, seed=seed, n=2)
    return prompt, SamplingParams(max_tokens=rng.randrange(1, 12), temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_operations_keep_books_and_outputs(model_folders, seed, overlap):
    rng = random.Random(seed)
    docs = [[rng.randrange(4) for _ in range(24)] for _ in range(3)]  # shared prefixes, 4-token alphabet
    # Largest request: 6 prompt blocks + 2 sequences x (3 more blocks + 1): 14 blocks. The pool has 16.
    engine = make_engine(model_folders["llama"], 16 * 2048, overlap)
    assert engine.pool.num_blocks == 16
    engine.step_hooks.append(Engine.check_invariants)
    submitted: dict[str, tuple[list[int], object]] = {}
    aborted: set[str] = set()
    faults = 0
    steps = run_length(2000, least=400)
    for _ in range(steps):
        op = rng.random()
        live = [r for r in submitted if r not in aborted and not engine.is_finished(r)]
        if op < 0.3:
            prompt, params = random_request(rng, docs)
            submitted[engine.add_request(prompt, params)] = (prompt, params)
        elif op < 0.36 and live:
            rid = rng.choice(live)
            engine.abort(rid)
            aborted.add(rid)
        elif op < 0.38:
            engine.runner.fail_next = True
            faults += 1
        else:
            engine.step()
    engine.runner.fail_next = False
    engine.run_until(lambda: not engine.has_unfinished_requests())
    engine.check_invariants()
    assert engine.kv.num_live_tables() == 0
    assert engine.pool.num_free + engine.kv.cache.evictable_size == engine.pool.num_blocks

    roomy = make_engine(model_folders["llama"], "8MiB")
    done, failed = {}, 0
    for rid in submitted:
        if rid in aborted:
            engine.forget(rid)
            continue
        try:
            done[rid] = engine.result(rid)
        except RequestError as exc:
            assert isinstance(exc.__cause__, Fault)
            failed += 1
    expected = {rid: roomy.add_request(*submitted[rid]) for rid in done}
    roomy.run_until(lambda: not roomy.has_unfinished_requests())
    greedy = 0
    for rid, got in done.items():
        prompt, params = submitted[rid]
        want = roomy.result(expected[rid])
        if isinstance(params, BeamSearchParams):
            assert [b.token_ids for b in got] == [b.token_ids for b in want]
        else:
            assert [s.token_ids for s in got.samples] == [s.token_ids for s in want.samples]
            if params.temperature == 0:
                assert got.token_ids == greedy_oracle(prompt, params.max_tokens)
                greedy += 1
    assert engine.metrics()["num_preemptions"] > 0 and engine.metrics()["prefix_cache_hits"] > 0
    assert failed > 0 and aborted and greedy > steps // 40 and faults > 0
