"""Failure containment: a step that raises fails its own batch's requests and nothing else.

The forward pass is made to raise once (at a prefill chunk, at a decode step, in a beam step);
the requests of that step get a RequestError chained to the fault, requests outside it finish
as a fresh engine would, the cache serves no uncomputed KV (the failed prompts, sent again, give
a fresh engine's outputs), and no block is leaked.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest

from radixkv import BeamSearchParams, Engine, RequestError, SamplingParams
from radixkv.scheduler.chunk import SequenceChunk

KW = {"block_size": 4, "kv_cache_memory": "8MiB", "max_num_batched_tokens": 16, "max_num_seqs": 4}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
BEAMS = BeamSearchParams(beam_width=2, max_tokens=6)


class Fault(RuntimeError):
    pass


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(256) for _ in range(n)] for n in (40, 6, 9, 7)]


def inject_once(engine: Engine, when: Callable[[list[SequenceChunk]], bool]) -> list[int]:
    """Makes the forward raise `Fault` the first time `when(chunks)` holds; returns a list that
    records the step at which it did."""
    forward, fired = engine.runner.forward, []

    def faulty(chunks: list[SequenceChunk]):
        if not fired and when(chunks):
            fired.append(engine.num_steps)
            raise Fault("injected")
        return forward(chunks)

    engine.runner.forward = faulty
    return fired


def mid_prefill(chunks: list[SequenceChunk]) -> bool:
    return any(c.logits == "none" and c.start_pos > 0 for c in chunks)  # a later chunk of a long prompt


def decode(chunks: list[SequenceChunk]) -> bool:
    return all(len(c.token_ids) == 1 for c in chunks)


def beam_step(chunks: list[SequenceChunk]) -> bool:
    return sum(len(c.token_ids) == 1 for c in chunks) >= 2


def no_leaks(engine: Engine) -> None:
    engine.check_invariants()
    assert engine.kv.num_live_tables() == 0 and engine.kv.pending_copies == []
    assert engine.pool.num_free + engine.kv.cache.evictable_size == engine.pool.num_blocks


@pytest.fixture(scope="module")
def fresh(model_folders) -> tuple[list[list[int]], list[list[int]]]:
    engine = Engine.from_pretrained(model_folders["llama"], **KW)
    samples = [o.token_ids for o in engine.generate(prompts(), GREEDY)]
    beams = [[b.token_ids for b in engine.beam_search(p, BEAMS)] for p in prompts()[1:3]]
    return samples, beams


@pytest.mark.parametrize("when", [mid_prefill, decode, beam_step])
def test_a_failed_step_fails_only_its_batch_and_caches_no_uncomputed_kv(model_folders, fresh, when):
    engine = Engine.from_pretrained(model_folders["llama"], **KW)
    engine.step_hooks.append(Engine.check_invariants)  # right after the failed step too
    fired = inject_once(engine, when)
    batch = prompts()
    ids = [engine.add_request(p, GREEDY) for p in batch[:3]]
    beam_ids = [engine.add_request(p, BEAMS) for p in batch[1:3]] if when is beam_step else []
    late = []
    while engine.has_unfinished_requests():
        engine.step()
        if fired and not late:  # submitted after the failure: must be untouched by it
            late = [engine.add_request(batch[3], GREEDY)]
    assert fired, "the fault never fired: the test exercised nothing"
    failed = 0
    for i, rid in enumerate(ids + late):
        try:
            assert engine.output(rid).token_ids == fresh[0][[0, 1, 2, 3][i]]
        except RequestError as exc:
            assert isinstance(exc.__cause__, Fault) and rid in str(exc)
            failed += 1
    for i, rid in enumerate(beam_ids):
        try:
            assert [b.token_ids for b in engine.beam_output(rid)] == fresh[1][i]
        except RequestError:
            failed += 1
    assert 0 < failed < len(ids + late + beam_ids)
    no_leaks(engine)
    # The failed prompts again: the cache holds only KV that was really computed.
    assert [o.token_ids for o in engine.generate(batch, GREEDY)] == fresh[0]
    assert [[b.token_ids for b in engine.beam_search(p, BEAMS)] for p in batch[1:3]] == fresh[1]
    no_leaks(engine)


def test_generate_raises_the_request_error_and_the_engine_stays_usable(model_folders, fresh):
    engine = Engine.from_pretrained(model_folders["llama"], **KW)
    inject_once(engine, decode)
    with pytest.raises(RequestError) as info:
        engine.generate(prompts()[1:3], GREEDY)
    assert isinstance(info.value.__cause__, Fault)
    assert [o.token_ids for o in engine.generate(prompts()[1:3], GREEDY)] == fresh[0][1:3]
    no_leaks(engine)


def test_submission_does_not_wait_for_the_step_in_flight(model_folders):
    engine = Engine.from_pretrained(model_folders["llama"], **KW)
    release, entered = threading.Event(), threading.Event()
    forward = engine.runner.forward

    def slow(chunks):
        entered.set()
        assert release.wait(30)
        return forward(chunks)

    engine.runner.forward = slow
    stepper = threading.Thread(target=engine.generate, args=([prompts()[1]], GREEDY))
    stepper.start()
    assert entered.wait(30)
    start = time.perf_counter()
    rid = engine.add_request(prompts()[2], GREEDY)  # the step holds its lock, blocked in forward
    waited = time.perf_counter() - start
    release.set()
    stepper.join(60)
    assert waited < 1.0, f"add_request waited {waited:.2f}s for the step in flight"
    engine.run_until(lambda: engine.is_finished(rid))
    assert len(engine.output(rid).token_ids) == 8


def test_a_beam_update_that_fails_halfway_leaks_nothing(model_folders):
    """The fault strikes inside the beam bookkeeping: the prompt's sequence becomes three beams,
    and the second fork raises after the first was made. The owner registry still finds and
    releases every table, the one the half-done update made included."""
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    engine = Engine.from_pretrained(model_folders["llama"], **KW)
    want = [b.token_ids for b in engine.beam_search(prompts()[1], params)]
    engine = Engine.from_pretrained(model_folders["llama"], **KW)
    fork, forks = engine.kv.fork, []

    def failing_fork(table):
        forks.append(table)
        if len(forks) == 2:
            raise Fault("injected in the beam update")
        return fork(table)

    engine.kv.fork = failing_fork
    rid = engine.add_request(prompts()[1], params)
    engine.run_until(lambda: engine.is_finished(rid))
    engine.kv.fork = fork
    with pytest.raises(RequestError):
        engine.beam_output(rid)
    no_leaks(engine)
    assert [b.token_ids for b in engine.beam_search(prompts()[1], params)] == want


def test_a_failed_block_copy_fails_its_step_and_releases_the_copy_sources(model_folders, fresh):
    """Beams fork and write into shared blocks, so their steps copy blocks first; the copy raises
    once. The step's requests fail, the copies' source references go back, and the engine then
    gives a fresh engine's beams."""
    engine = Engine.from_pretrained(model_folders["llama"], **KW)
    copy, fired = engine.runner.copy_blocks, []

    def faulty(src: list[int], dst: list[int]) -> None:
        if not fired:
            fired.append(engine.num_steps)
            raise Fault("injected")
        copy(src, dst)

    engine.runner.copy_blocks = faulty
    prompt = prompts()[1]
    with pytest.raises(RequestError) as info:
        engine.beam_search(prompt, BEAMS)
    assert fired and isinstance(info.value.__cause__, Fault)
    no_leaks(engine)
    assert [b.token_ids for b in engine.beam_search(prompt, BEAMS)] == fresh[1][0]
    no_leaks(engine)
