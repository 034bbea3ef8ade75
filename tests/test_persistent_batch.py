"""The persistent batch against a batch rebuilt from scratch, over random runs of table changes."""

from __future__ import annotations

import random

import pytest
import torch

from radixkv.model.persistent_batch import PersistentBatch
from radixkv.scheduler.chunk import SequenceChunk

NUM_BLOCKS, BLOCK_SIZE, MAX_LEN = 64, 4, 80


def check_against_scratch(batch: PersistentBatch, chunks: list[SequenceChunk]) -> None:
    step = batch.prepare(chunks)
    tokens, positions, slots, rows = [], [], [], []
    for chunk in chunks:
        n = len(chunk.token_ids)
        if chunk.logits == "last":
            rows.append(len(tokens) + n - 1)
        elif chunk.logits == "all":
            rows.extend(range(len(tokens), len(tokens) + n))
        for j, token in enumerate(chunk.token_ids):
            pos = chunk.start_pos + j
            tokens.append(token)
            positions.append(pos)
            slots.append(chunk.block_table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    assert step.input_ids[0].tolist() == tokens
    assert step.position_ids[0].tolist() == positions
    assert step.slot_mapping.tolist() == slots
    assert step.logit_rows.tolist() == rows
    assert step.seq_lens.tolist() == [c.start_pos + len(c.token_ids) for c in chunks]
    starts = [0]
    for chunk in chunks:
        starts.append(starts[-1] + len(chunk.token_ids))
    assert step.query_start_loc.tolist() == starts
    for i, chunk in enumerate(chunks):
        assert step.block_table[i, : len(chunk.block_table)].tolist() == chunk.block_table
    for g, (group_slots, group_table) in enumerate(zip(step.group_slots, step.group_tables, strict=True)):
        expected = []
        for i, chunk in enumerate(chunks):  # a KV group's own slots and rows
            table = chunk.group_tables[g]
            assert group_table[i, : len(table)].tolist() == table
            for j in range(len(chunk.token_ids)):
                pos = chunk.start_pos + j
                expected.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        assert group_slots.tolist() == expected
    assert len(step.group_tables) == (len(chunks[0].group_tables) if chunks else 0)
    # Every tensor of the step starts 16-byte aligned whatever the batch's sizes (Triton compiles a
    # kernel variant per alignment of its pointer arguments).
    tensors = [*step[:7], *step.group_slots, *step.group_tables]
    assert all(t.data_ptr() % 16 == 0 for t in tensors)


@pytest.mark.parametrize(("seed", "groups"), [(0, 1), (1, 1), (2, 1), (3, 3)])
def test_rows_follow_grown_swapped_and_reordered_tables(seed: int, groups: int) -> None:
    """`groups` KV groups: groups 1.. have tables of their own, whose leading entries are
    released now and then (a sliding window's null block, 0 here)."""
    rng = random.Random(seed)
    batch = PersistentBatch(NUM_BLOCKS, BLOCK_SIZE, MAX_LEN, torch.device("cpu"), groups)
    seqs: list[tuple[list[int], int]] = []  # (block table, tokens computed)
    others: dict[int, list[list[int]]] = {}  # id of a block table -> its groups' tables
    for _ in range(60):
        if len(seqs) < 6 and rng.random() < 0.4:
            seqs.insert(rng.randrange(len(seqs) + 1), ([], 0))
        if len(seqs) > 1 and rng.random() < 0.2:
            seqs.pop(rng.randrange(len(seqs)))
        chunks = []
        for k, (table, done) in enumerate(seqs):
            n = rng.choice([1, 1, 1, rng.randint(1, 9)])
            if done + n > MAX_LEN:
                table, done = [], 0
                seqs[k] = (table, done)
            while len(table) * BLOCK_SIZE < done + n:
                table.append(rng.randrange(NUM_BLOCKS))  # grows in place, like a BlockTable's list
            if table and rng.random() < 0.1:
                table[rng.randrange(len(table))] = rng.randrange(NUM_BLOCKS)  # copy-on-write, in place
            mine = others.setdefault(id(table), [[] for _ in range(groups - 1)])
            for other in mine:
                other[len(table) :] = []
                while len(other) < len(table):
                    other.append(rng.randrange(1, NUM_BLOCKS))
                if rng.random() < 0.2:  # released blocks before the ones written now
                    released = rng.randrange(done // BLOCK_SIZE + 1)
                    other[:released] = [0] * released
            mode = rng.choice(["last", "last", "all", "none"])
            tokens = [rng.randrange(256) for _ in range(n)]
            chunks.append(SequenceChunk(tokens, done, table, mode, mine))
            seqs[k] = (table, done + n)
        if chunks:
            check_against_scratch(batch, chunks)


def test_a_bad_block_id_is_refused_and_the_row_rewritten_after() -> None:
    batch = PersistentBatch(NUM_BLOCKS, BLOCK_SIZE, MAX_LEN, torch.device("cpu"))
    table = [3, 5]
    check_against_scratch(batch, [SequenceChunk([1], 4, table)])
    table.append(NUM_BLOCKS)
    with pytest.raises(ValueError, match="block ids"):
        batch.prepare([SequenceChunk([1], 8, table)])
    table[-1] = 7
    check_against_scratch(batch, [SequenceChunk([1], 8, table)])


def test_tables_wider_than_max_model_len_widen_the_buffer() -> None:
    batch = PersistentBatch(NUM_BLOCKS, BLOCK_SIZE, 8, torch.device("cpu"))
    check_against_scratch(batch, [SequenceChunk([1, 2], 6, [9, 4, 11, 12, 13])])
