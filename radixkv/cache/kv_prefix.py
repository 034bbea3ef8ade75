"""The manager's side of the prefix cache: a sequence's match at admission, its inserts as it
computes and finishes, and the read-only looks at what is cached.

A table admitted here holds a reference on every matched block and a lock on the matched path;
`cache_running` moves that lock forward as whole blocks are computed, `cache_finished` inserts
what was computed and releases the table. With sliding-window KV groups a match is cut to the
longest prefix whose window every sliding group still holds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixkv.cache.block_table import BlockTable
from radixkv.cache.kv_groups import sliding_keep_from, valid_match_end
from radixkv.cache.salt import salt_offset, salted

if TYPE_CHECKING:
    from radixkv.kvstore.store import StoredRun


class KVPrefix:
    """Mixed into `KVCacheManager`, which holds `pool`, `cache` (None without a prefix cache),
    `windows`, `null_block` and registers tables (`_register`)."""

    def admit(
        self,
        tokens: list[int],
        owner: object = None,
        session: str | None = None,
        stored: StoredRun | None = None,
        salt: str | None = None,
        max_match: int | None = None,
    ) -> BlockTable:
        """A table for a new sequence, holding the longest cached prefix of `tokens` but the
        last token, which is always computed so that its logits exist, and at most `max_match`
        tokens (positions whose logits are wanted are computed). A `session` is live from its
        first admission until `close_session`. `stored`: blocks of `tokens` fetched from the KV
        store (keyed as the cache keys them, salted); those that continue the tree's match join
        the tree (`load_stored`). `salt` (a request's `cache_salt`) limits what it matches and
        caches to its namespace."""
        offset = salt_offset(salt)

        def empty() -> BlockTable:
            extra = [[] for _ in self.windows]
            table = BlockTable([], owner=owner, session=session, key_offset=offset, extra=extra)
            return self._register(table)

        if self.cache is None:
            return empty()
        if session is not None:
            self.cache.set_session_live(session, True)
        limit = len(tokens) - 1 if max_match is None else min(len(tokens) - 1, max_match)
        if limit < 1:
            return empty()
        keys = salted(tokens[:limit], offset)
        match = self.cache.match_prefix(keys, session)
        if self.windows:
            end = self._valid_end(match.num_tokens, match.extra)
            if end < match.num_tokens:  # a sliding group lacks the window before the match's end
                match = self.cache.match_prefix(keys[:end], session)
        fetched = 0
        if stored is not None and stored.blocks:
            fetched = self.cache.load_stored(keys, match, stored, session)
            if fetched:
                match = self.cache.match_prefix(keys, session)
        self.cache.inc_lock(match.node)
        self.pool.incref_all(match.blocks)
        blocks, loaded = list(match.blocks), match.host_tokens
        extra = []
        for window, e in zip(self.windows, match.extra, strict=True):
            # a sliding group takes only its window: the entries before it stay null, so a
            # table's freed entries are always its leading ones (`release_windows`)
            keep = 0 if window is None else sliding_keep_from(match.num_tokens, window, self.block_size)
            extra.append([self.null_block] * keep + e[keep:])
            self.pool.incref_all(e[keep:])
            self.cache.touch_stale(e[keep:])
        table = BlockTable(
            blocks,
            match.num_tokens,
            match.node,
            owner,
            session,
            num_loaded_tokens=loaded,
            num_stored_tokens=fetched,
            key_offset=offset,
            extra=extra,
        )
        return self._register(table)

    def _valid_end(self, num_tokens: int, extra: tuple[list[int], ...]) -> int:
        """The longest prefix of a match of `num_tokens` tokens whose window every sliding group
        holds, `extra` being the groups' blocks along it."""
        end, last = num_tokens, -1
        while end != last:  # a cut for one group needs every other group's check again
            last = end
            for window, blocks in zip(self.windows, extra, strict=True):
                if window is not None:
                    end = valid_match_end(blocks, self.null_block, end, window, self.block_size)
        return end

    def keep_window(self, tokens: list[int], salt: str | None = None) -> None:
        """Makes the stale sliding-group blocks that a match of `tokens` (the next request to
        admit) reads the most recently used (`RadixCache.touch_stale`), so that what the running
        requests take meanwhile releases other stale blocks first and the request still hits
        its prefix when room comes; locks, touches and changes nothing else. No-op without KV
        groups."""
        if self.cache is None or not self.windows or len(tokens) < 2:
            return
        matched, extra = self.cache.peek_groups(salted(tokens[:-1], salt_offset(salt)))
        end = self._valid_end(matched, extra)
        for window, blocks in zip(self.windows, extra, strict=True):
            if window is not None:
                first = sliding_keep_from(end, window, self.block_size)
                self.cache.touch_stale(blocks[first : self.blocks_for(end)])

    def cached_prefix_len(self, tokens: list[int], salt: str | None = None) -> int:
        """How many leading tokens of `tokens` the cache holds in `salt`'s namespace (0 without a
        cache); changes nothing."""
        if self.cache is None:
            return 0
        return self.cache.cached_prefix_len(salted(tokens, salt_offset(salt)))

    def close_session(self, session: str) -> None:
        """The chat session has no more turns: its cached blocks lose their live-session rank."""
        if self.cache is not None:
            self.cache.set_session_live(session, False)

    def cache_finished(self, table: BlockTable, tokens: list[int], num_computed: int | None = None) -> None:
        """Caches the sequence's computed tokens (a finished or preempted sequence), then
        releases the table: its next turn, or its own resumption, finds them. `num_computed`
        (default: every slot of the table) leaves out slots a step in flight still computes."""
        computed = table.num_tokens if num_computed is None else num_computed
        if self.cache is not None and computed:
            keys = salted(tokens[:computed], table.key_offset)
            self.cache.insert(keys, table.blocks, table.session, table.extra)
        self.release(table)

    def cache_running(self, table: BlockTable, tokens: list[int], num_computed: int | None = None) -> None:
        """Caches the whole blocks of a sequence that keeps running, so that requests waiting
        on the same new prefix hit it now. The table moves its lock to the new path and swaps
        any duplicate block for the cache's own (freeing the duplicate). `num_computed` as in
        `cache_finished`."""
        if self.cache is None:
            return
        computed = table.num_tokens if num_computed is None else num_computed
        full = computed - computed % self.block_size
        locked = table.node.end if table.node is not None else 0
        if full <= locked:
            return
        keys = salted(tokens[:full], table.key_offset)
        self.cache.insert(keys, table.blocks, table.session, table.extra)
        match = self.cache.match_prefix(keys, table.session)
        self.cache.inc_lock(match.node)
        if table.node is not None:
            self.cache.dec_lock(table.node)
        table.node = match.node
        # Only the whole blocks of the locked path: where the insert declined a run (a hash
        # collision), the match ends early, perhaps inside a block of some other prefix.
        locked = match.node.end // self.block_size
        null = self.null_block
        for ours, cached in zip((table.blocks, *table.extra), (match.blocks, *match.extra), strict=True):
            for i, b in enumerate(cached[:locked]):
                if ours[i] != b and b != null and ours[i] != null:
                    self.pool.incref(b)
                    self.pool.decref(ours[i])
                    ours[i] = b
