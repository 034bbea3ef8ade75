from radixkv.sampling_params import SamplingParams
from radixkv.scheduler.request import Request, Sequence
from radixkv.scheduler.waiting_queue import AGING_TOKENS_PER_STEP, WaitingQueue


def request(name: str, tokens: list[int], arrival: float) -> Request:
    return Request(name, tokens, SamplingParams(), [Sequence(tokens, len(tokens))], arrival_time=arrival)


def test_lpm_puts_the_longest_cached_prefix_first_and_aging_stops_starvation():
    cached = {1: 1024, 2: 0, 3: 64}  # first token -> cached prefix length
    queue = WaitingQueue("lpm", lambda tokens, salt: cached[tokens[0]])
    old_cold, hot, warm = request("cold", [2], 0.0), request("hot", [1], 1.0), request("warm", [3], 2.0)
    for r in (old_cold, hot, warm):
        queue.add(r)
    assert [r.request_id for r in queue.ordered()] == ["hot", "warm", "cold"]
    queue.remove(hot)
    for _ in range(1024 // AGING_TOKENS_PER_STEP + 1):
        queue.age()
    queue.add(request("hot, but new", [1], 3.0))
    # Having waited long enough, the cold request overtakes a new one with 1,024 cached tokens.
    assert [r.request_id for r in queue.ordered()] == ["warm", "cold", "hot, but new"]


def test_fcfs_keeps_arrival_order():
    queue = WaitingQueue("fcfs", lambda tokens, salt: 10**6 if tokens[0] == 1 else 0)
    for r in (request("b", [1], 2.0), request("a", [2], 1.0)):
        queue.add(r)
    assert [r.request_id for r in queue.ordered()] == ["a", "b"]


def test_without_a_prefix_cache_the_order_is_fcfs():
    queue = WaitingQueue("lpm", None)
    assert queue.policy == "fcfs"
