import json
import random
from collections import OrderedDict

import pytest
from shared_traces import random_hash_trace, shared_trace

from radixkv.cache import BlockPool, KVCacheManager, RadixCache
from radixkv.cli import main
from radixkv.tools.simulate import CacheRequest, hit_tokens, requests_from_workload, serve
from radixkv.workloads.format import Session, Turn, Workload
from radixkv.workloads.traces import HashIdTokens

MOONCAKE = shared_trace("mooncake_synthetic_trace.jsonl")


def block_lru_hits(requests: list[list[int]], capacity: int, hash_block: int) -> int:
    """An independent block-level LRU over hash ids: the leading run of cached ids hits, then
    every id of the request is touched, its deepest first, so that a prefix outlives its
    extensions. The engine always recomputes a prompt's last token, hence the one token less."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for ids in requests:
        k = 0
        while k < len(ids) and ids[k] in cache:
            k += 1
        hits += k * hash_block - (k == len(ids))
        for i in reversed(ids):
            cache[i] = None
            cache.move_to_end(i)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


@pytest.mark.parametrize("seed", range(6))
def test_lru_hits_equal_an_independent_block_level_lru(seed):
    rng = random.Random(seed)
    trace = random_hash_trace(rng, 300)
    hash_block = rng.choice([1, 4, 16])
    capacity = rng.randint(max(map(len, trace)), 200)
    tokens = HashIdTokens(hash_block)
    requests = [CacheRequest(0.0, tokens.tokens(ids), []) for ids in trace]
    assert hit_tokens(requests, capacity, hash_block, "lru") == block_lru_hits(trace, capacity, hash_block)


def test_next_turn_hits_the_previous_prompt_and_reply():
    session = Session("s", [Turn([1, 2, 3, 4, 5], 4), Turn([6, 7], 3, think=1.0)], system=[9] * 8)
    first, second = requests_from_workload(Workload([session], {}), tokenizer=None)
    assert second.prompt[: len(first.prompt) + 4] == first.prompt + first.output
    hits = hit_tokens([first, second], capacity_blocks=64, block_size=4, eviction="lru")
    assert hits == len(first.prompt) + len(first.output)


def test_simulate_json_has_the_contract_fields(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 10 * i, "input_length": 30, "output_length": 2, "hash_ids": [0, 1, i + 2]}
        for i in range(5)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert (
        main(
            [
                "simulate",
                str(trace),
                "--capacity-blocks",
                "8",
                "--hash-block",
                "4",
                "--block-size",
                "4",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    for key in (
        "requests",
        "prompt_tokens",
        "hit_tokens",
        "hit_rate",
        "ideal_hit_rate",
        "capacity_blocks",
        "block_size",
        "eviction",
    ):
        assert key in out
    assert out["requests"] == 5 and out["prompt_tokens"] == 60
    assert out["hit_tokens"] == 4 * 8  # each later request finds the two shared ids
    assert out["hit_rate"] == pytest.approx(32 / 60)


def test_bad_capacity_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "x.jsonl", "--capacity-blocks", "many"])
    assert "capacit" in capsys.readouterr().err


@pytest.mark.skipif(not MOONCAKE.exists(), reason="the shared Mooncake trace is not present")
def test_mooncake_lru_hit_rates_match_the_reference_table(capsys):
    expected = {1000: 0.084, 4000: 0.235, 16000: 0.530}
    assert (
        main(
            [
                "simulate",
                str(MOONCAKE),
                "--hash-block",
                "16",
                "--block-size",
                "16",
                "--capacity-blocks",
                "1000,4000,16000",
                "--json",
            ]
        )
        == 0
    )
    for row in json.loads(capsys.readouterr().out):
        assert row["hit_rate"] == pytest.approx(expected[row["capacity_blocks"]], abs=0.0015)
        assert row["ideal_hit_rate"] == pytest.approx(0.640, abs=0.01)


def test_copy_on_write_sources_are_released_so_no_block_leaks():
    # Each prompt comes twice: the second matches 5 of its 6 tokens, ending inside a block, so
    # it copies that block. A copy that kept its source's reference would leak the source once
    # the tree evicts it.
    pool = BlockPool(4, 4)
    kv = KVCacheManager(pool, RadixCache(pool))
    requests = []
    for i in range(30):
        prompt = [100 + i] * 6
        requests += [CacheRequest(0.0, prompt, []), CacheRequest(0.0, list(prompt), [])]
    assert serve(kv, requests).tokens == 30 * 5
    kv.check_invariants([])
    assert pool.num_free + kv.cache.evictable_size == pool.num_blocks
