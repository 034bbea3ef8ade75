"""The order in which waiting requests are considered for admission.

`fcfs`: arrival order. `lpm` (longest prefix match): the request with the most prompt tokens
already cached goes first, since it costs the least to start and its cached prefix is the most
likely to be evicted if it waits. Alone that starves requests with no cached prefix, so each step
waited adds `AGING_TOKENS_PER_STEP` to a request's priority: a request with nothing cached
overtakes one with 1,024 cached tokens after 16 steps. With more than `LPM_MAX_WAITING` requests
waiting, the prefix lookups per step would cost more than they save, and the order is `fcfs`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from radixkv.scheduler.request import Request

AGING_TOKENS_PER_STEP = 64
LPM_MAX_WAITING = 256


class WaitingQueue:
    """Waiting requests and their order. Ordering costs a prefix lookup per request, so the
    scheduler asks for it (`ordered`) only when admission can take something; aging is O(1) a step
    (a step counter; a request's `waited_steps` is brought up to date when it leaves the queue)."""

    def __init__(self, policy: str, cached_prefix_len: Callable[[list[int], str | None], int] | None) -> None:
        """`cached_prefix_len(tokens, cache_salt)`: how much of a prompt the cache holds for a
        request of that salt (None: no cache, so `fcfs`)."""
        self.policy = policy if cached_prefix_len is not None else "fcfs"
        self._cached_prefix_len = cached_prefix_len
        self._requests: list[Request] = []
        self._step = 0
        self._added_at: dict[Request, int] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._requests))

    def __contains__(self, request: object) -> bool:
        return request in self._requests

    def add(self, request: Request) -> None:
        self._requests.append(request)
        self._added_at[request] = self._step

    def remove(self, request: Request) -> None:
        self._requests.remove(request)
        request.waited_steps = self._waited(request)
        del self._added_at[request]

    def _waited(self, request: Request) -> int:
        return request.waited_steps + self._step - self._added_at[request]

    def ordered(self) -> list[Request]:
        """The waiting requests, the next to admit first. A preempted request keeps its arrival
        time, so under `fcfs` it resumes ahead of everything that came after it."""
        if self.policy == "fcfs" or len(self._requests) > LPM_MAX_WAITING:
            return sorted(self._requests, key=lambda r: r.arrival_time)
        prefix = self._cached_prefix_len

        def priority(r: Request) -> tuple[int, float]:
            tokens = r.seqs[0].tokens
            return (-(prefix(tokens, r.cache_salt) + self._waited(r) * AGING_TOKENS_PER_STEP), r.arrival_time)

        return sorted(self._requests, key=priority)

    def age(self) -> None:
        """One more step waited by every request in the queue."""
        self._step += 1
