"""Host-tier loads written layer by layer during the forward (`radixkv.model.layered_load`).

The runner against a reference that makes every copy at once, in queue order, over random runs of
copies, offloads and loads; the engine on multi-turn chats whose turns come back from the host
tier (transformers' greedy output, and an engine without a host tier); and a fault in the middle
of a layered load, which fails only its step's requests and leaves the cache's data and books
intact. The CPU runs the same path as CUDA but for the side stream: each layer's blocks are
written when its attention waits for them.
"""

from __future__ import annotations

import random

import pytest
import torch
from test_engine import transformers_greedy
from test_engine_host_tier import engine, prompts
from test_failures import no_leaks

from radixkv import Engine, RequestError, SamplingParams
from radixkv.model.layered_load import LayeredLoad
from radixkv.model.runner import ModelRunner
from radixkv.scheduler.chunk import SequenceChunk

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def check_transfers_against_copies_at_once(runner: ModelRunner, monkeypatch, steps: int = 25) -> None:
    """Copies, offloads and loads in random order, each step then a forward over block 0 alone:
    the device and host tensors equal a reference (on the CPU) that copies every transfer when
    it is called. Copies that read or overwrite loaded blocks join the layered load; offloads
    that read them finish it first; both happen."""
    num_blocks, num_host = runner.num_blocks, runner.host.num_blocks
    generator = torch.Generator().manual_seed(0)
    runner.kv_cache.copy_(torch.randn(runner.kv_cache.shape, generator=generator))
    runner.host.tensor.copy_(torch.randn(runner.host.tensor.shape, generator=generator))
    device, host = runner.kv_cache.cpu(), runner.host.tensor.clone()
    joined = []
    add_copy = LayeredLoad.add_copy
    monkeypatch.setattr(LayeredLoad, "add_copy", lambda self, s, d: (joined.append(s), add_copy(self, s, d)))
    rng = random.Random(0)
    for _ in range(steps):
        for _ in range(rng.randrange(1, 6)):
            kind, n = rng.choice(["copy", "offload", "load"]), rng.randrange(1, 4)
            if kind == "copy":
                blocks = rng.sample(range(1, num_blocks), 2 * n)
                src, dst = blocks[:n], blocks[n:]
                runner.copy_blocks(src, dst)
                device[:, :, dst] = device[:, :, src]
            elif kind == "offload":
                src, dst = rng.sample(range(1, num_blocks), n), rng.sample(range(num_host), n)
                runner.offload(src, dst)
                host[:, :, dst] = device[:, :, src]
            else:
                src, dst = rng.sample(range(num_host), n), rng.sample(range(1, num_blocks), n)
                runner.load(src, dst)
                device[:, :, dst] = host[:, :, src]
        runner.forward([SequenceChunk([5, 6, 7], 0, [0])])  # writes block 0, which no transfer touches
        assert runner.pending_load is None
        assert torch.equal(runner.kv_cache[:, :, 1:].cpu(), device[:, :, 1:])
        assert torch.equal(runner.host.tensor, host)
    assert runner.num_layered_loads > 0 and runner.num_early_loads > 0 and joined


def test_deferred_loads_leave_the_cache_as_copies_made_at_once_would(llama_gqa, monkeypatch):
    runner = ModelRunner(llama_gqa, num_blocks=16, block_size=4, num_host_blocks=12)
    check_transfers_against_copies_at_once(runner, monkeypatch)


def chat_turns(
    e: Engine, num_chats: int, num_turns: int, on_failure=None
) -> list[tuple[list[int], list[int]]]:
    """Round-robin multi-turn chats: each turn's prompt is the last one, its answer and new
    tokens. Returns every (prompt, answer) in order. A turn that fails goes to `on_failure`
    (the error and its prompt), which answers it instead."""
    rng = random.Random(3)
    chats = [[rng.randrange(256) for _ in range(36)] for _ in range(num_chats)]
    turns = []
    for _ in range(num_turns):
        for i, prompt in enumerate(chats):
            try:
                answer = e.generate([prompt], GREEDY)[0].token_ids
            except RequestError as error:
                if on_failure is None:
                    raise
                answer = on_failure(error, prompt)
            turns.append((prompt, answer))
            chats[i] = prompt + answer + [rng.randrange(256) for _ in range(rng.randrange(3, 9))]
    return turns


@pytest.mark.slow
def test_chats_that_come_back_from_the_host_match_transformers(model_folders, reference_models, monkeypatch):
    """Six chats of three turns over a device pool of 24 blocks: later turns load their earlier
    turns from the host (each ending in a partly matched block, whose copy-on-write copy reads a
    block loaded in the same step). Every answer equals transformers' greedy one and that of an
    engine without a host tier."""
    joined = []
    add_copy = LayeredLoad.add_copy
    monkeypatch.setattr(LayeredLoad, "add_copy", lambda self, s, d: (joined.append(s), add_copy(self, s, d)))
    tiered = engine(model_folders, device_kib=48, host_kib=256)
    turns = chat_turns(tiered, num_chats=6, num_turns=3)
    m = tiered.metrics()
    assert m["num_loaded_blocks"] > 0 and m["host_cache_hits"] > 0
    assert tiered.runner.num_layered_loads > 0 and joined, "no load ran layer by layer with a copy joined"
    plain = engine(model_folders, device_kib=48)
    assert chat_turns(plain, num_chats=6, num_turns=3) == turns
    for prompt, answer in turns:
        assert answer == transformers_greedy(reference_models["llama"], prompt, 8)


class Fault(RuntimeError):
    pass


def fail_layer_1(e: Engine, monkeypatch, whole_step: bool) -> list[int]:
    """Makes a layered load raise at layer 1 the first time it gets there, and, with
    `whole_step`, every time in that step; returns the steps it raised in."""
    run_layer, fired = LayeredLoad._run_layer, []

    def faulty(self, layer):
        if layer == 1 and (not fired or (whole_step and fired[0] == e.num_steps)):
            fired.append(e.num_steps)
            raise Fault("injected at layer 1")
        run_layer(self, layer)

    monkeypatch.setattr(LayeredLoad, "_run_layer", faulty)
    return fired


@pytest.mark.parametrize("whole_step", [False, True], ids=["once", "whole-step"])
def test_a_fault_in_the_forward_s_layered_load_fails_only_its_step(
    model_folders, reference_models, monkeypatch, whole_step
):
    """Four chats of two turns as above; the first load fails at layer 1's attention. Once: the
    forward's cleanup finishes the load. For the whole step: the cleanup fails too, the load
    stays pending and the next step resumes it. Only that turn fails (every other answer is
    transformers'); nothing leaks and the books hold after every step; the failed turn, sent
    again, finds on the device the blocks the failed step loaded (it loads nothing) and answers
    as transformers does, so their data is whole."""
    e = engine(model_folders, device_kib=48, host_kib=256)
    fired = fail_layer_1(e, monkeypatch, whole_step)
    failures = []

    def again(error: RequestError, prompt: list[int]) -> list[int]:
        assert isinstance(error.__cause__, Fault) and not failures
        assert (e.runner.pending_load is not None) == whole_step and e.runner.num_early_loads == 0
        no_leaks(e)
        cached, loaded = e.kv.cache.cached_prefix_len(prompt), e.metrics()["num_loaded_blocks"]
        out = e.generate([prompt], GREEDY)[0]
        assert loaded > 0 and e.metrics()["num_loaded_blocks"] == loaded
        assert out.num_cached_tokens == min(cached, len(prompt) - 1) > 0
        failures.append(prompt)
        return out.token_ids

    turns = chat_turns(e, num_chats=4, num_turns=2, on_failure=again)
    assert failures and len(set(fired)) == 1 and len(fired) == 1 + whole_step
    assert e.runner.pending_load is None
    no_leaks(e)
    for prompt, answer in turns:
        assert answer == transformers_greedy(reference_models["llama"], prompt, 8)


def test_a_fault_in_a_load_finished_early_fails_only_its_step(model_folders, reference_models, monkeypatch):
    """a, b, c cached in turn over 48 blocks, so a goes to the host; loading a back evicts, in
    the same step, a block it loads, so that offload finishes the load first, and it raises
    there. The offload stays queued and runs after the resumed load in the next step. The step
    fails; a request submitted after is untouched; nothing leaks; a, sent again, hits all of its
    prompt and answers as transformers does."""
    a, b, c, late = prompts(4, seed=1, low=100, high=101)
    e = engine(model_folders, device_kib=96, host_kib=256)
    for p in (a, b, c):
        e.generate([p], GREEDY)
    fired = fail_layer_1(e, monkeypatch, whole_step=False)
    with pytest.raises(RequestError) as info:
        e.generate([a], GREEDY)
    assert isinstance(info.value.__cause__, Fault) and fired and e.runner.pending_load is not None
    no_leaks(e)
    assert e.generate([late], GREEDY)[0].token_ids == transformers_greedy(reference_models["llama"], late, 8)
    assert e.runner.pending_load is None and e.runner.num_early_loads == 1
    again = e.generate([a], GREEDY)[0]
    assert again.num_cached_tokens == len(a) - 1
    assert again.token_ids == transformers_greedy(reference_models["llama"], a, 8)
    no_leaks(e)


class ReplayStandIn:
    """Stands in for `DecodeGraphs` on a CPU: takes the steps a graph would (one new token and
    one logits row per sequence) and runs them as a replay does, reading every layer's cache
    without a call back for the step's loads."""

    failed = False

    def __init__(self, runner: ModelRunner) -> None:
        self.runner, self.replays = runner, 0

    def fits(self, step) -> bool:
        return step.input_ids.shape[1] == step.seq_lens.shape[0] == step.logit_rows.shape[0]

    def run(self, step) -> torch.Tensor:
        self.replays += 1
        output = self.runner.model(
            input_ids=step.input_ids,
            position_ids=step.position_ids,
            use_cache=False,
            logits_to_keep=step.logit_rows,
            paged_batch=self.runner.paged_batch(step),
        )
        return output.logits[0].float()


def test_a_decode_step_that_replays_a_graph_finishes_its_loads_first(model_folders):
    """Swap preemption over 52 blocks: swapped-out decodes come back in pure decode steps, which
    a CUDA graph replays; their loads are finished before the replay, and the outputs are an
    unpreempted run's."""
    batch = prompts(6, seed=2, low=20, high=40)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = Engine.from_pretrained(model_folders["llama"], block_size=4, kv_cache_memory="8MiB")
    expected = [o.token_ids for o in roomy.generate(batch, params)]
    tight = engine(model_folders, device_kib=104, host_kib=512, preemption_mode="swap")
    tight.runner.graphs = ReplayStandIn(tight.runner)
    assert [o.token_ids for o in tight.generate(batch, params)] == expected
    assert tight.runner.graphs.replays > 0 and tight.runner.num_early_loads > 0
    assert tight.metrics()["num_swapped_in_blocks"] > 0


def test_an_offload_larger_than_its_staging_moves_every_block_to_its_place():
    from radixkv.model.host_kv import OFFLOAD_CHUNK_BLOCKS, HostKVCache

    generator = torch.Generator().manual_seed(0)
    device_cache = torch.randn((2, 3, 100, 4, 2, 8), generator=generator)
    host = HostKVCache(90, device_cache)
    count = 2 * OFFLOAD_CHUNK_BLOCKS + 5
    src = random.Random(0).sample(range(100), count)
    dst = random.Random(1).sample(range(90), count)
    host.offload(device_cache, src, dst)
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(host.tensor[:, :, d], device_cache[:, :, s])
