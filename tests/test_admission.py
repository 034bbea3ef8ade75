"""Admission that counts exactly, forks counted from admission, beams bounded by max_model_len."""

from __future__ import annotations

import random

from radixkv import BeamSearchParams, Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
ROOMY = {"block_size": 4, "kv_cache_memory": "8MiB"}


def rand(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(256) for _ in range(n)]


def test_blocks_shared_by_partial_hits_are_not_counted_as_evictable(model_folders):
    """Three cached prompts of 6 tokens (a whole block of 4 and a partly filled one). Three new
    prompts each match 5 tokens of one, sharing its partly filled block, which eviction can then
    not free. Admitted in one step with nothing else running, the third needs exactly one block
    more than allocation plus eviction can deliver: counting the shared blocks as evictable, it
    was admitted and `OutOfBlocks` escaped the scheduler. Counted exactly, it waits its turn."""
    rng = random.Random(0)
    bases = [rand(rng, 6) for _ in range(3)]
    follow = [bases[0][:5] + [1], bases[1][:5] + [2], bases[2][:5] + rand(rng, 32)]  # 37 tokens: 10 blocks
    kw = {"block_size": 4, "max_num_batched_tokens": 64}
    roomy = Engine.from_pretrained(model_folders["llama"], kv_cache_memory="8MiB", **kw)
    want = [o.token_ids for o in roomy.generate(follow, GREEDY)]
    engine = Engine.from_pretrained(model_folders["llama"], kv_cache_memory=16 * 2048, **kw)
    assert engine.pool.num_blocks == 16
    engine.generate(bases, SamplingParams(max_tokens=1, temperature=0.0))
    assert (engine.pool.num_free, engine.kv.cache.evictable_size) == (10, 6)
    engine.step_hooks.append(Engine.check_invariants)
    ids = [engine.add_request(p, GREEDY) for p in follow]
    engine.step()
    assert [engine._requests[i].status.value for i in ids] == ["running", "running", "waiting"]
    engine.run_until(lambda: all(engine.is_finished(i) for i in ids))
    assert [engine.output(i).token_ids for i in ids] == want
    assert engine.kv.num_live_tables() == 0


def test_forks_count_against_max_num_seqs_from_admission(model_folders):
    engine = Engine.from_pretrained(model_folders["llama"], **ROOMY, max_num_seqs=4)
    peak = 0

    def track(e: Engine) -> None:
        nonlocal peak
        peak = max(peak, sum(len(r.seqs) for r in e.scheduler.running))

    engine.step_hooks.append(track)
    rng = random.Random(1)
    params = SamplingParams(max_tokens=6, n=3, seed=0, ignore_eos=True)
    outs = engine.generate([rand(rng, 8), rand(rng, 8)], params)
    assert [len(o.samples) for o in outs] == [3, 3]
    assert peak == 3, f"{peak} sequences ran at once, max_num_seqs is 4"


def test_beams_stop_at_max_model_len(model_folders):
    engine = Engine.from_pretrained(model_folders["llama"], **ROOMY, max_model_len=28)
    prompt = rand(random.Random(2), 20)
    beams = engine.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=16, ignore_eos=True))
    assert len(beams) == 3
    assert all(len(b.token_ids) == 8 and b.finish_reason == "length" for b in beams)
    roomy = Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="8MiB")
    same = roomy.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    assert [b.token_ids for b in beams] == [b.token_ids for b in same]  # as if max_tokens were 8
    engine.check_invariants()
