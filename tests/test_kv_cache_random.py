"""Seeded random runs of the whole cache core against a naive model of sequences.

The naive model is a plain list of cached token sequences, each with its cache salt: a query's
longest cached prefix is its longest common prefix with any of them of the same salt. Besides,
every block carries fake KV (the token written at each slot), so a write into a shared block, a
copy that went missing or a block handed to two owners shows up as a sequence that no longer
reads back its own tokens.
"""

import random

import numpy as np
import pytest
from random_runs import run_length

from radixkv.cache import radix_invariants, radix_tree
from radixkv.cache.block_pool import BlockPool, OutOfBlocks
from radixkv.cache.eviction import Adaptive, EvictionPolicy, make_policy
from radixkv.cache.host_tier import HostTier
from radixkv.cache.kv_cache_manager import BlockTable, KVCacheManager
from radixkv.cache.kv_groups import kv_groups, sliding_keep_from
from radixkv.cache.radix_cache import RadixCache
from radixkv.cache.salt import TOKEN_BITS, salt_offset
from radixkv.kvstore import KeySpace, StoredBlock, StoredRun

TOKEN_MASK = (1 << TOKEN_BITS) - 1


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    k = 0
    while k < n and a[k] == b[k]:
        k += 1
    return k


class Harness:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        seed: int,
        policy: str | EvictionPolicy = "lru",
        host_blocks: int = 0,
        write_through: bool = False,
        exact: bool = True,
        salts: bool = False,
    ) -> None:
        """`exact`: matches must be as long as the naive reference's. Without (forced hash
        collisions), the cache may decline to cache a run, so matches may be shorter, never wrong.
        A host tier of `host_blocks` (0: none) may also shorten a match, when loading its host
        part runs out of device blocks; the tiers together must still hold the whole prefix.
        `salts`: requests come in three cache namespaces (no salt, "x", "y")."""
        self.rng = random.Random(seed)
        self.exact = exact
        self.short_matches = 0
        self.B = block_size
        self.pool = BlockPool(num_blocks, block_size)
        self.host = HostTier(host_blocks, block_size, write_through=write_through) if host_blocks else None
        policy = make_policy(policy) if isinstance(policy, str) else policy
        self.cache = RadixCache(self.pool, policy, self.host)
        self.kv = KVCacheManager(self.pool, self.cache, "swap" if host_blocks else "recompute")
        self.owners = iter(range(10**9))
        self.swapped: list[tuple[int, list[int], str | None]] = []  # (owner, computed tokens, salt)
        self.restored = 0  # swapped sequences that came back whole
        self.slots = np.full((num_blocks, block_size), -1, dtype=np.int64)  # fake KV
        self.host_slots = np.full((max(host_blocks, 1), block_size), -1, dtype=np.int64)
        self.salts = [None, "x", "y"] if salts else [None]
        self.salt_at = {salt_offset(salt): salt for salt in self.salts}
        self.reference: list[tuple[str | None, list[int]]] = []
        self.live: list[tuple[BlockTable, list[int]]] = []
        self.salt_of: dict[BlockTable, str | None] = {}
        # A few long "documents" over a 3-letter alphabet: prompts share prefixes and diverge
        # inside blocks often.
        self.docs = [[self.rng.randrange(3) for _ in range(6 * block_size)] for _ in range(4)]

    def prompt(self) -> list[int]:
        doc = self.rng.choice(self.docs)
        cut = self.rng.randrange(1, len(doc))
        tail = [self.rng.randrange(3) for _ in range(self.rng.randrange(0, 2 * self.B))]
        return doc[:cut] + tail

    # ---------------------------------------------------------------- operations

    def admit(self) -> None:
        tokens, owner, resumed = self.prompt(), next(self.owners), None
        salt = self.rng.choice(self.salts) if len(self.salts) > 1 else None
        if self.swapped and self.rng.random() < 0.3:  # a swapped-out sequence is readmitted
            owner, resumed, salt = self.swapped.pop(self.rng.randrange(len(self.swapped)))
            tokens = resumed + [self.rng.randrange(3)]
        session = self.rng.choice([None, "a", "b", "c"])
        table = self.kv.admit(tokens, owner, session, salt=salt)
        self.salt_of[table] = salt
        if resumed is not None:
            self.kv.swap_in(owner)
            self.restored += table.num_tokens == len(resumed)
        same_salt = [seq for s, seq in self.reference if s == salt]
        expected = max((common_prefix(tokens[:-1], seq) for seq in same_salt), default=0)
        if self.host is None:
            assert table.num_tokens == expected or (not self.exact and table.num_tokens < expected), (
                f"matched {table.num_tokens}, reference {expected}"
            )
        else:
            assert table.num_tokens <= expected, f"matched {table.num_tokens}, reference {expected}"
            assert self.kv.cached_prefix_len(tokens[:-1], salt) == expected, "a tier lost KV"
        self.short_matches += table.num_tokens < expected
        self.live.append((table, tokens))
        self.append(len(self.live) - 1, len(tokens) - table.num_tokens)

    def append(self, i: int, n: int) -> None:
        self.grow([(i, n)])

    def grow(self, plan: list[tuple[int, int]]) -> None:
        """Grows several live sequences in one all-or-nothing reservation, as a request's
        sequences (samples, beams) grow together."""
        starts = []
        for i, n in plan:
            table, tokens = self.live[i]
            while len(tokens) < table.num_tokens + n:
                tokens.append(self.rng.randrange(3))
            starts.append(table.num_tokens)
        reservation = [(self.live[i][0], n) for i, n in plan]
        need, available = self.kv.blocks_needed(reservation), self.kv.num_available
        try:
            self.kv.reserve(reservation)
        except OutOfBlocks:
            assert [self.live[i][0].num_tokens for i, _ in plan] == starts, (
                "a failed reservation changed a table"
            )
            assert need > available, f"num_available promised {available} blocks, {need} could not be had"
            return
        assert need <= available, f"num_available said {available} blocks, but {need} were had"
        self.kv.run_transfers(self)
        for (i, n), start in zip(plan, starts, strict=True):
            table, tokens = self.live[i]
            for p in range(start, start + n):
                self.slots[table.blocks[p // self.B], p % self.B] = tokens[p]

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        assert len(set(dst)) == len(dst) and not set(dst) & set(src), "a batch must copy in parallel"
        self.slots[dst] = self.slots[src]

    def offload(self, src: list[int], dst: list[int]) -> None:
        assert len(set(dst)) == len(dst)
        self.host_slots[dst] = self.slots[src]

    def load(self, src: list[int], dst: list[int]) -> None:
        assert len(set(dst)) == len(dst)
        self.slots[dst] = self.host_slots[src]

    def step(self) -> None:
        self.tracking_evictions(self.operate)

    def tracking_evictions(self, op) -> None:
        """Runs `op`; if it evicted anything (explicitly, or to make room for an allocation), the
        reference forgets what the cache did."""
        evicted = self.cache.num_evicted, self.host and self.host.num_evicted
        op()
        if (self.cache.num_evicted, self.host and self.host.num_evicted) != evicted:
            self.forget_evicted()

    def operate(self) -> None:
        op = self.rng.random()
        if len(self.live) > 12:  # keep the run churning rather than piling up sequences
            op = 0.7
        if op < 0.25 or not self.live:
            self.admit()
        elif op < 0.45:
            self.append(self.rng.randrange(len(self.live)), self.rng.randrange(1, 2 * self.B + 2))
        elif op < 0.5:
            table, tokens = self.rng.choice(self.live)
            fork = self.kv.fork(table)
            self.salt_of[fork] = self.salt_of[table]
            self.live.append((fork, list(tokens)))
        elif op < 0.55:
            picked = self.rng.sample(range(len(self.live)), min(3, len(self.live)))
            self.grow([(i, self.rng.randrange(1, self.B + 2)) for i in picked])
        elif op < 0.65:
            table, tokens = self.rng.choice(self.live)
            self.kv.cache_running(table, tokens)
            full = table.num_tokens - table.num_tokens % self.B
            if full:
                self.reference.append((self.salt_of[table], tokens[:full]))
        elif op < 0.8:
            table, tokens = self.live.pop(self.rng.randrange(len(self.live)))
            computed, owner, salt = table.num_tokens, table.owner, self.salt_of.pop(table)
            if computed:
                self.reference.append((salt, tokens[:computed]))
            if self.host is not None and self.rng.random() < 0.5:
                self.kv.preempt(table, tokens)  # swap: to the host, pinned until readmitted
                if computed:
                    self.swapped.append((owner, tokens[:computed], salt))
            else:
                self.kv.cache_finished(table, tokens)
        elif op < 0.86:
            table, _ = self.live.pop(self.rng.randrange(len(self.live)))
            del self.salt_of[table]
            self.kv.release(table)
        elif op < 0.88:
            self.kv.close_session(self.rng.choice(["a", "b", "c"]))
        else:
            self.evict(self.rng.randrange(1, 3 * self.B))

    def evict(self, n: int) -> None:
        free_before = self.pool.num_free
        freed = self.cache.evict(n)
        assert self.pool.num_free == free_before + freed
        # A block that a live fork still references loses only the cache's reference, so
        # eviction may take more than n cached blocks, but it stops at n freed ones.
        assert freed == n or (freed < n and self.cache.evictable_size == 0)

    def forget_evicted(self) -> None:
        """Eviction only forgets: whatever the cache still holds (on either tier) was cached
        before, and the reference now holds just that."""
        cached = [self.unsalted(seq) for seq in self.cache.cached_sequences()]
        for salt, seq in cached:
            same_salt = [s for sl, s in self.reference if sl == salt]
            assert any(s[: len(seq)] == seq for s in same_salt), "evict invented KV"
        self.reference = cached

    def unsalted(self, keys: list[int]) -> tuple[str | None, list[int]]:
        """A cached key sequence as (salt, tokens): the salt from its offset, which must be one
        of the run's and the same along the whole sequence."""
        offsets = {t & ~TOKEN_MASK for t in keys}
        assert len(offsets) == 1 and next(iter(offsets)) in self.salt_at, "a cached run mixes namespaces"
        return self.salt_at[next(iter(offsets))], [t & TOKEN_MASK for t in keys]

    # ------------------------------------------------------------------ checks

    def check(self) -> None:
        self.kv.run_transfers(self)  # as the engine does before every forward pass
        self.kv.check_invariants(t for t, _ in self.live)
        nodes = list(self.cache.nodes())  # one walk of the tree serves every check below
        unlocked = [b for n in nodes if n is not self.cache.root and not n.lock_ref for b in n.blocks]
        only_cached = sum(self.pool.refcount(b) == 1 for b in unlocked)  # what eviction would free
        assert self.kv.num_available == self.pool.num_free + only_cached, "num_available is not exact"
        # Every live sequence and every cached node (device and host) must read back its own
        # tokens: all of them compared in one gather, and only on a mismatch is the culprit named.
        device = [(tokens[: t.num_tokens], t.blocks, f"sequence KV of {t}") for t, tokens in self.live]
        host = []
        for node in nodes:
            tokens = [t & TOKEN_MASK for t in node.tokens]
            if node.blocks:
                device.append((tokens, node.blocks, f"cached KV of {node}"))
            if node.host_blocks:
                host.append((tokens, node.host_blocks, f"host KV of {node}"))
        for runs, slots in ((device, self.slots), (host, self.host_slots)):
            if not self.reads_back(runs, slots):
                bad = next(run for run in runs if not self.reads_back([run], slots))
                raise AssertionError(f"{bad[2]} corrupted")
        assert self.kv.slot_usage(t for t, _ in self.live) == self.slot_usage_recount(nodes)

    def slot_usage_recount(self, nodes: list) -> tuple[int, int]:
        """Slots holding KV, block by block from scratch: a cached block holds its node's tokens, a
        live table's block its positions; a block held several times counts once, at its fullest."""
        filled: dict[int, int] = {}
        for node in nodes:
            for i, b in enumerate(node.blocks):
                filled[b] = min(self.B, len(node.tokens) - i * self.B)
        for table, _ in self.live:
            for i, b in enumerate(table.blocks):
                filled[b] = max(filled.get(b, 0), min(self.B, table.num_tokens - i * self.B))
        return sum(filled.values()), (self.kv.pool.num_blocks - self.kv.pool.num_free) * self.B

    def reads_back(self, runs: list[tuple[list[int], list[int], str]], slots: np.ndarray) -> bool:
        """Whether each run's blocks hold its tokens, slot by slot (runs: (tokens, blocks, name))."""
        rows, cols, want = [], [], []
        for tokens, blocks, _ in runs:
            pos = np.arange(len(tokens))
            rows.append(np.asarray(blocks, dtype=np.int64)[pos // self.B])
            cols.append(pos % self.B)
            want.append(np.asarray(tokens, dtype=np.int64))
        if not want:
            return True
        return np.array_equal(slots[np.concatenate(rows), np.concatenate(cols)], np.concatenate(want))


class CyclingAdaptive(Adaptive):
    """`adaptive` deciding every 16 sampled blocks, each decision overruled to the next setting
    (the miniatures' own decision still runs): every switch, GDSF's re-keying of every leaf
    included, comes round again and again."""

    def __init__(self) -> None:
        super().__init__(decide_every=16)

    def sized(self, num_blocks: int, block_size: int) -> None:
        super().sized(num_blocks, block_size)
        minis = self.miniatures
        decide = minis.decide

        def cycle(current: int, margin: float) -> int:
            decide(current, margin)
            return (current + 1) % len(minis.settings)

        minis.decide = cycle


def assert_cycled(policy) -> None:
    if isinstance(policy, CyclingAdaptive):
        assert len({s for _, s in policy.trajectory}) == len(policy.miniatures.settings)


@pytest.mark.parametrize(
    ("block_size", "seed", "policy"),
    [(1, 0, "lru"), (16, 1, "lru"), (64, 2, "lru"), (4, 3, "lru"), (4, 4, "gdsf"), (16, 5, "session")]
    + [(1, 6, "adaptive"), (4, 7, "adaptive-cycling"), (16, 8, "adaptive-cycling")],
)
def test_random_operations_match_the_naive_reference(block_size, seed, policy):
    # Small enough that eviction and OutOfBlocks happen all the time.
    if policy == "adaptive-cycling":
        policy = CyclingAdaptive()
    h = Harness(block_size, num_blocks=max(48, 600 // block_size), seed=seed, policy=policy)
    run(h, run_length(5000))
    assert_cycled(policy)


@pytest.mark.parametrize(
    ("block_size", "seed", "policy", "host_blocks", "write_through"),
    [
        (4, 10, "lru", 40, False),
        (16, 11, "gdsf", 25, False),
        (1, 12, "lru", 150, True),
        (4, 13, "session", 9, True),
        (4, 14, "adaptive", 40, False),
        (16, 15, "adaptive", 25, True),
    ],
)
def test_random_operations_with_a_host_tier_keep_every_tokens_kv(
    block_size, seed, policy, host_blocks, write_through
):
    """Fake KV written per slot survives offload and load-back bit for bit, on both tiers."""
    if policy == "adaptive":
        policy = CyclingAdaptive()
    h = Harness(block_size, max(40, 400 // block_size), seed, policy, host_blocks, write_through)
    run(h, run_length(4000, least=800))
    assert_cycled(policy)
    host = h.host
    assert host.num_offloaded and host.num_loaded and host.num_evicted, "the host tier was not exercised"
    assert h.kv.num_swapped_out_blocks and h.restored, "no swapped-out sequence came back whole"


@pytest.mark.parametrize(("block_size", "seed", "host_blocks"), [(4, 20, 0), (1, 21, 0), (4, 22, 40)])
def test_random_operations_with_salts_share_blocks_only_within_a_salt(block_size, seed, host_blocks):
    """Three namespaces over the same prompts: a match never reaches another salt's blocks, and
    every rule of the cache (eviction, forks, the host tier and swap) holds in each."""
    h = Harness(block_size, max(48, 600 // block_size), seed, host_blocks=host_blocks, salts=True)
    run(h, run_length(3000))
    salts = {salt for salt, _ in h.reference}
    assert len(salts) == 3, "the run did not cache under every salt"


def run(h: Harness, steps: int) -> None:
    for _ in range(steps):
        h.step()
        h.check()
    while h.live:
        h.kv.release(h.live.pop()[0])
    h.check()
    assert h.pool.num_free + h.cache.evictable_size == h.pool.num_blocks, "blocks leaked"
    assert h.cache.protected_size == 0


@pytest.mark.parametrize(("block_size", "seed"), [(1, 4), (4, 5), (16, 6)])
def test_hash_collisions_never_return_another_prefixs_kv(monkeypatch, block_size, seed):
    """With a block key of one bit, most children collide: the cache must compare tokens, find
    the right child by its first token, and decline to cache a run whose key is taken. The fake
    KV check proves no match ever returns blocks holding other tokens."""
    one_bit = lambda tokens: sum(tokens) % 2
    for module in (radix_tree, radix_invariants):  # the tree keys children by it, the recount checks them
        monkeypatch.setattr(module, "block_key", one_bit)
    h = Harness(block_size, num_blocks=max(48, 600 // block_size), seed=seed, exact=False)
    for _ in range(run_length(2000, least=1000)):
        h.step()
        h.check()
    assert h.short_matches > 0, "no collision made the cache decline a run: the branches went untested"
    while h.live:
        h.kv.release(h.live.pop()[0])
    h.check()
    assert h.pool.num_free + h.cache.evictable_size == h.pool.num_blocks, "blocks leaked"


class AppendSlotHarness(Harness):
    """Takes one-token growth through `append_slot` (the decode step's O(1) path) where it
    applies, else through `reserve` as the engine does; the naive reference checks the data."""

    fast = 0

    def append(self, i: int, n: int) -> None:
        table, tokens = self.live[i]
        start = table.num_tokens
        if n != 1 or self.rng.random() < 0.2:
            return super().append(i, n)
        free, shared = self.pool.num_free, start % self.B and self.pool.refcount(table.blocks[-1]) > 1
        if not self.kv.append_slot(table):
            assert table.num_tokens == start, "a refused append_slot changed the table"
            assert shared or (start % self.B == 0 and free == 0), "append_slot refused a slot it could take"
            return super().append(i, n)
        assert not shared, "append_slot wrote into a shared block"
        taken = free - self.pool.num_free
        assert taken == (start % self.B == 0), f"append_slot took {taken} blocks"
        while len(tokens) <= start:
            tokens.append(self.rng.randrange(3))
        self.slots[table.blocks[start // self.B], start % self.B] = tokens[start]
        self.fast += 1


@pytest.mark.parametrize(("block_size", "seed"), [(1, 20), (4, 21), (16, 22)])
def test_append_slot_takes_only_a_slot_reserve_would_take(block_size, seed):
    h = AppendSlotHarness(block_size, num_blocks=max(48, 600 // block_size), seed=seed)
    for _ in range(run_length(3000)):
        if h.live and h.rng.random() < 0.5:  # many one-token appends, as decode steps make
            i = h.rng.randrange(len(h.live))
            h.tracking_evictions(lambda i=i: h.append(i, 1))
        else:
            h.step()
        h.check()
    assert h.fast > run_length(3000) // 10, "append_slot was hardly exercised"


class StoreHarness(Harness):
    """The cache with a KV store behind it: saves copy a block's fake KV into a dict under its
    key, admissions continue their match with the stored run, and every check reads back the
    tokens of every cached block, fetched ones included."""

    def __init__(self, block_size: int, num_blocks: int, seed: int, policy: str = "lru") -> None:
        super().__init__(block_size, num_blocks, seed, policy)
        self.keyspace = KeySpace("test", "fake", block_size)
        self.cache.store_keys = self.keyspace
        self.stored: dict[bytes, np.ndarray] = {}
        self.fetched_tokens = 0

    def save(self, src: list[int], keys: list[bytes]) -> None:
        for b, k in zip(src, keys, strict=True):
            assert (self.slots[b] >= 0).all(), "a block was saved before its KV was written"
            self.stored[k] = self.slots[b].copy()

    def fetch(self, src: list[StoredBlock], dst: list[int]) -> None:
        self.slots[dst] = np.stack([s.payload for s in src])

    def admit(self) -> None:
        tokens, owner = self.prompt(), next(self.owners)
        keys = self.keyspace.block_keys(tokens[:-1], len(tokens))
        start = self.cache.cached_prefix_len(tokens[:-1]) // self.B
        run = []
        for key in keys[start:]:
            if key not in self.stored:
                break
            run.append(StoredBlock(self.stored[key]))
        table = self.kv.admit(tokens, owner, None, StoredRun(start, run))
        self.salt_of[table] = None
        expected = max((common_prefix(tokens[:-1], s) for _, s in self.reference), default=0)
        assert table.num_tokens >= expected, f"matched {table.num_tokens}, the tree alone {expected}"
        assert table.num_tokens <= max(expected, (start + len(run)) * self.B)
        self.fetched_tokens += table.num_stored_tokens
        self.reference.append((None, tokens[: table.num_tokens]))
        self.live.append((table, tokens))
        self.append(len(self.live) - 1, len(tokens) - table.num_tokens)


@pytest.mark.slow
@pytest.mark.parametrize(("block_size", "seed", "policy"), [(2, 30, "lru"), (4, 31, "lru"), (16, 32, "gdsf")])
def test_random_operations_with_a_kv_store_keep_every_tokens_kv(block_size, seed, policy):
    h = StoreHarness(block_size, max(48, 600 // block_size), seed, policy)
    run(h, run_length(2000))
    assert h.cache.num_saved and h.fetched_tokens, "the store was not exercised"


class GroupsHarness(AppendSlotHarness):
    """KV groups (`radixkv.cache.kv_groups`): a global layer and three sliding ones, two with a
    window wider than two blocks and one with a window inside a block. The naive reference
    still bounds every match (a group may only cut it short), the fake KV of every group's
    blocks must read back inside its window, and a sequence readmitted right after it was
    cached must match whole: what the tree keeps of a path is at least the window before its
    end, in every group (unless the path runs on past it: then the longer path's windows decide)."""

    def __init__(self, block_size: int, num_blocks: int, seed: int, policy: str = "lru") -> None:
        super().__init__(block_size, num_blocks, seed, policy, exact=False)
        wide, narrow = 2 * block_size + 1, max(1, block_size // 2 + 1)
        self.kv = KVCacheManager(self.pool, self.cache, groups=kv_groups((wide, None, narrow, wide)))
        self.windows = self.kv.windows
        assert self.windows == (wide, wide, narrow)  # groups of one layer, the widest first
        self.resumed = 0
        self.released = 0  # sliding blocks released from a live table
        self.saw_stale = False

    def grow(self, plan: list[tuple[int, int]]) -> None:
        starts = [self.live[i][0].num_tokens for i, _ in plan]
        for i, _ in plan:  # what `reserve` releases first, so that num_available stays exact
            self.kv.release_windows(self.live[i][0])
        super().grow(plan)
        for (i, _), start in zip(plan, starts, strict=True):  # the groups' fake KV, as every layer
            table, tokens = self.live[i]  # is written (nothing, when the reservation failed)
            for blocks in table.extra:
                for p in range(start, table.num_tokens):
                    self.slots[blocks[p // self.B], p % self.B] = tokens[p]

    def append(self, i: int, n: int) -> None:
        table, tokens = self.live[i]
        start = table.num_tokens
        if n != 1 or self.rng.random() < 0.3 or not self.kv.append_slot(table):
            return Harness.append(self, i, n)
        while len(tokens) <= start:
            tokens.append(self.rng.randrange(3))
        for blocks in (table.blocks, *table.extra):
            self.slots[blocks[start // self.B], start % self.B] = tokens[start]
        self.fast += 1

    def admit(self) -> None:
        super().admit()  # exact=False: a group may cut the reference's match short, never lengthen it
        self.released += sum(b == self.kv.null_block for e in self.live[-1][0].extra for b in e)

    def operate(self) -> None:
        if self.reference and self.rng.random() < 0.05:  # a waiting request keeps its window
            salt, done = self.rng.choice(self.reference)
            self.kv.keep_window(done + [self.rng.randrange(3)], salt)
        if not self.live or self.rng.random() > 0.1:
            return super().operate()
        table, tokens = self.live.pop(self.rng.randrange(len(self.live)))
        computed, salt = table.num_tokens, self.salt_of.pop(table)
        self.kv.cache_finished(table, tokens)
        if not computed:
            return
        done = tokens[:computed]
        # Where the tree's path runs on past the sequence, that longer path's windows decide.
        longer = (q for s, q in self.reference if s == salt and len(q) > computed)
        ends_here = not any(q[:computed] == done for q in longer)
        self.reference.append((salt, done))
        again = done + [self.rng.randrange(3)]
        resumed = self.kv.admit(again, next(self.owners), salt=salt)
        if ends_here:
            assert resumed.num_tokens == computed, f"resumed at {resumed.num_tokens} of {computed} cached"
            self.resumed += 1
        self.salt_of[resumed] = salt
        self.live.append((resumed, again))
        self.append(len(self.live) - 1, 1)

    def evict(self, n: int) -> None:
        free_before = self.pool.num_free
        freed = self.cache.evict(n)
        assert self.pool.num_free == free_before + freed
        # a position's blocks of every group go together: up to groups - 1 past n
        assert n <= freed < n + len(self.windows) + 1 or (freed < n and self.cache.evictable_size == 0)

    def check(self) -> None:
        self.kv.run_transfers(self)
        self.kv.check_invariants(t for t, _ in self.live)
        null = self.kv.null_block
        nodes = [n for n in self.cache.nodes() if n is not self.cache.root and not n.lock_ref]
        unlocked = [b for n in nodes for b in n.blocks + [b for e in n.extra for b in e if b != null]]
        self.saw_stale |= bool(self.cache.stale)
        # stale group blocks of locked nodes too (the tree releases them first)
        unlocked += [b for b in self.cache.stale if self.cache._node_of[b].lock_ref]
        only_cached = sum(self.pool.refcount(b) == 1 for b in unlocked)
        assert self.kv.num_available == self.pool.num_free + only_cached, "num_available is not exact"
        runs = [(tokens[: t.num_tokens], t.blocks, f"group 0 KV of {t}") for t, tokens in self.live]
        for table, tokens in self.live:
            for window, blocks in zip(self.windows, table.extra, strict=True):
                lo = sliding_keep_from(table.num_tokens, window, self.B) * self.B
                assert self.reads_back_from(lo, tokens[: table.num_tokens], blocks), "a group's KV corrupted"
        nodes = list(self.cache.nodes())
        for node in nodes:
            tokens = [t & TOKEN_MASK for t in node.tokens]
            if node.blocks:
                runs.append((tokens, node.blocks, f"cached KV of {node}"))
            for blocks in node.extra:
                for i, b in enumerate(blocks):
                    if b != null:
                        part = tokens[i * self.B : (i + 1) * self.B]
                        runs.append((part, [b], f"a group's cached KV of {node}"))
        if not self.reads_back(runs, self.slots):
            bad = next(run for run in runs if not self.reads_back([run], self.slots))
            raise AssertionError(f"{bad[2]} corrupted")
        assert self.kv.slot_usage(t for t, _ in self.live) == self.slot_usage_recount(nodes)

    def reads_back_from(self, lo: int, tokens: list[int], blocks: list[int]) -> bool:
        pos = np.arange(lo, len(tokens))
        ids = np.asarray(blocks, dtype=np.int64)[pos // self.B]
        return np.array_equal(self.slots[ids, pos % self.B], np.asarray(tokens[lo:], dtype=np.int64))

    def slot_usage_recount(self, nodes: list) -> tuple[int, int]:
        filled: dict[int, int] = {}
        null = self.kv.null_block
        for node in nodes:
            for blocks in (node.blocks, *node.extra):
                for i, b in enumerate(blocks):
                    if b != null:
                        filled[b] = min(self.B, len(node.tokens) - i * self.B)
        for table, _ in self.live:
            for blocks in (table.blocks, *table.extra):
                for i, b in enumerate(blocks):
                    if b != null:
                        filled[b] = max(filled.get(b, 0), min(self.B, table.num_tokens - i * self.B))
        return sum(filled.values()), (self.kv.pool.num_blocks - self.kv.pool.num_free - 1) * self.B


@pytest.mark.parametrize(
    ("block_size", "seed", "policy"),
    [(1, 40, "lru"), (4, 41, "lru"), (8, 42, "adaptive"), (16, 43, "session")],
)
def test_random_operations_with_sliding_window_groups(block_size, seed, policy):
    """Windows freed for running sequences and in the tree, with forks, copy-on-write, eviction
    and OutOfBlocks throughout; no block leaks once every sequence is gone."""
    h = GroupsHarness(block_size, num_blocks=max(64, 900 // block_size), seed=seed, policy=policy)
    for _ in range(run_length(4000, least=600)):
        h.step()
        h.check()
    assert h.saw_stale, "no group block went stale"
    copies = h.kv.num_cow_copies or block_size == 1  # one-token blocks are never written shared
    assert h.resumed > 10 and h.released and copies and h.fast, "the groups went untested"
    while h.live:
        h.kv.release(h.live.pop()[0])
    h.check()
    cached = h.cache.evictable_size + len(h.cache.stale)
    assert h.pool.num_free + cached == h.pool.num_blocks - 1, "blocks leaked"


def test_stale_group_blocks_go_by_position_in_every_group_and_a_matched_window_last() -> None:
    """Eviction releases stale sliding blocks the farthest back first, every group's block of a
    position together (a match needs every group's window), and a window a match read (a request
    that waits for room) after the others: its hit survives the pressure."""
    B = 4
    pool = BlockPool(64, B)
    kv = KVCacheManager(pool, RadixCache(pool, make_policy("lru")), groups=kv_groups((None, 8, 8)))
    assert kv.windows == (8, 8)
    first = list(range(1, 41))
    table = kv.admit(first)
    kv.reserve([(table, len(first))])
    kv.cache_finished(table, first)  # blocks 0..7 of both sliding groups are stale now
    waiting = first[:20] + list(range(100, 110))
    table = kv.admit(waiting)
    assert table.num_tokens == 20  # it reads blocks 3 and 4 of each sliding group
    kv.release(table)  # no room yet: it waits

    def nulls() -> list[list[int]]:
        null = kv.null_block
        return [[i for i, b in enumerate(e) if b == null] for e in kv.cache.match_prefix(first).extra]

    assert kv.cache.evict(4) == 4
    assert nulls() == [[0, 1], [0, 1]]
    assert kv.cache.evict(8) == 8
    assert nulls() == [[0, 1, 2, 5, 6, 7], [0, 1, 2, 5, 6, 7]]
    table = kv.admit(waiting)
    assert table.num_tokens == 20
    kv.release(table)
    kv.check_invariants([])


def test_the_next_request_to_admit_keeps_its_window_through_newer_stale_blocks() -> None:
    """`keep_window` (the scheduler calls it for the head of the waiting queue each step) makes the
    stale blocks a waiting request's match reads the last that eviction releases, ahead of stale
    blocks made later, and changes nothing else; `peek_groups` gives what `match_prefix` does."""
    B = 4
    pool = BlockPool(64, B)
    kv = KVCacheManager(pool, RadixCache(pool, make_policy("lru")), groups=kv_groups((None, 8, 8)))
    first, second = list(range(1, 41)), list(range(200, 240))
    for tokens in (first, second):  # each leaves its blocks 0..7 stale in both sliding groups
        table = kv.admit(tokens)
        kv.reserve([(table, len(tokens))])
        kv.cache_finished(table, tokens)
    waiting = first[:20] + list(range(100, 110))  # its match reads blocks 3 and 4 of first's path

    def books() -> list[tuple[int, int, int, int]]:
        return [(n.id, n.last_access, n.hits, len(n.blocks)) for n in kv.cache.nodes()]

    before, sizes = books(), (kv.cache.evictable_size, len(kv.cache.stale), pool.num_free)
    kv.keep_window(waiting)
    assert books() == before and (kv.cache.evictable_size, len(kv.cache.stale), pool.num_free) == sizes
    assert kv.cache.evict(28) == 28  # all 32 stale blocks but 4
    null = kv.null_block
    kept = [[i for i, b in enumerate(e) if b != null] for e in kv.cache.match_prefix(first).extra]
    assert kept == [[3, 4, 8, 9], [3, 4, 8, 9]]  # the window of the hit, and of the path's end
    table = kv.admit(waiting)
    assert table.num_tokens == 20
    kv.release(table)
    for n in (0, 3, 17, 20, 39):  # the side-effect-free peek agrees with a match
        keys = second[:n]
        peeked = kv.cache.peek_groups(keys)
        match = kv.cache.match_prefix(keys)
        assert peeked == (match.num_tokens, match.extra)
    kv.check_invariants([])
