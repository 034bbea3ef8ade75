"""Host/device overlap (`EngineConfig.overlap`) gives what the serial engine gives.

The overlapped engine schedules step N+1 before step N's tokens are known, so a sequence that
stops at N runs one step more and that token is dropped; preemption, aborts and failures meet
steps in flight. Outputs are compared with transformers' greedy `generate` and with the serial
engine on the same requests (seeded sampling, beams, stop strings, logprobs), and the books are
checked after every step.
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_engine import checked, no_leaks, prompts

from radixkv import BeamSearchParams, Engine, RequestError, SamplingParams
from radixkv.engine import overlap
from radixkv.model import step_worker
from radixkv.model.step_worker import StepWorker
from radixkv.outputs import RequestOutput

POOL = {"block_size": 4, "kv_cache_memory": "8MiB", "max_num_batched_tokens": 32, "max_num_seqs": 8}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)


class Fault(RuntimeError):
    pass


def engine(folder, overlap: bool, **kw) -> Engine:
    return checked(Engine.from_pretrained(folder, overlap=overlap, **{**POOL, **kw}))


def mixed_requests(probe: Engine) -> list[tuple[list[int], SamplingParams | BeamSearchParams]]:
    """Greedy runs that stop on a stop string or a stop token midway or run to length, seeded
    samples (n = 2, with logprobs), a beam group, and a prompt longer than the step budget. The
    stops are read off `probe`'s greedy outputs, so that they fire."""
    ps = prompts(8, seed=21, low=4, high=30) + prompts(1, seed=22, low=70, high=71)
    long = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    text, ids = (o for o in probe.generate([ps[1], ps[7]], long))
    printable = [c for c in text.text[2:] if c.isascii() and c.isprintable()]
    assert printable, text.text
    return [
        (ps[0], SamplingParams(max_tokens=12, temperature=0.0)),
        (ps[1], SamplingParams(max_tokens=12, temperature=0.0, stop=[printable[0]])),
        (ps[2], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True, logprobs=2)),
        (ps[3], SamplingParams(max_tokens=9, temperature=1.0, seed=5, n=2, logprobs=1)),
        (ps[4], SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=6, presence_penalty=0.5)),
        (ps[5], BeamSearchParams(beam_width=2, max_tokens=6)),
        (ps[6], SamplingParams(max_tokens=1, temperature=0.0)),
        (ps[7], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[ids.token_ids[4]])),
        (ps[8], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)),
    ]


LOGPROB_TOL = 1e-4
"""Logprobs agree to float32 noise only: a row's matmuls differ with the batch it is computed in
(about 1e-6 here, relative), and the overlapped engine batches differently."""


def outcome(result) -> object:
    if isinstance(result, RequestOutput):
        return [
            (
                s.token_ids,
                s.text,
                s.finish_reason,
                [
                    (r.token_id, pytest.approx(r.logprob, abs=LOGPROB_TOL), [t for t, _ in r.top])
                    for r in s.logprobs or []
                ],
            )
            for s in result.samples
        ]
    return [(b.token_ids, b.finish_reason) for b in result]


def run_all(eng: Engine, requests, steps_between: int = 2) -> dict[str, object]:
    """Submits the requests in three waves, stepping in between, and runs them out."""
    ids = []
    for wave in (requests[:3], requests[3:6], requests[6:]):
        ids += [eng.add_request(p, params) for p, params in wave]
        for _ in range(steps_between):
            eng.step()
    eng.run_until(lambda: not eng.has_unfinished_requests())
    return {rid: outcome(eng.result(rid)) for rid in ids}


def test_overlap_gives_the_serial_outputs(model_folders):
    requests = mixed_requests(engine(model_folders["llama"], overlap=False))
    serial = run_all(engine(model_folders["llama"], overlap=False), requests)
    overlapped = engine(model_folders["llama"], overlap=True)
    got = run_all(overlapped, requests)
    assert list(got.values()) == list(serial.values())
    reasons = {r[2] for out in serial.values() for r in out if len(r) == 4}
    assert {"stop", "length"} <= reasons  # both ends were reached
    no_leaks(overlapped)


def count_worker_resolutions(monkeypatch) -> list[bool]:
    """Records each step whose placeholders the worker filled, True where the step before it
    had failed (its tokens then replaced by a harmless one)."""
    calls: list[bool] = []
    write = overlap._write_argmaxes

    def counted(input_ids, where, logits, source) -> None:
        calls.append(logits.exception() is not None)
        write(input_ids, where, logits, source)

    monkeypatch.setattr(overlap, "_write_argmaxes", counted)
    return calls


@pytest.mark.parametrize(
    ("params", "on_worker"),
    [
        (SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), True),
        (SamplingParams(max_tokens=10, temperature=0.9, seed=3, ignore_eos=True), False),
        (SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, ignore_eos=True), False),
    ],
    ids=["greedy", "seeded-sampling", "greedy-with-a-penalty"],
)
def test_greedy_placeholders_are_resolved_on_the_worker_others_by_the_host(
    model_folders, monkeypatch, params, on_worker
):
    """A decode step whose placeholders are all plain greedy sequences' is submitted before the
    step ahead of it is sampled, the worker writing their tokens (the argmaxes of that step's
    logits): at least the 8 decode steps after the first of each sequence's 10 tokens. A sampled
    or penalized sequence waits for the host's sampling. Either way the outputs are the serial
    engine's."""
    resolved = count_worker_resolutions(monkeypatch)
    batch = prompts(5, seed=9, low=6, high=20)
    serial = [o.token_ids for o in engine(model_folders["llama"], overlap=False).generate(batch, params)]
    overlapped = engine(model_folders["llama"], overlap=True)
    assert [o.token_ids for o in overlapped.generate(batch, params)] == serial
    fewest, most = (8, overlapped.num_steps) if on_worker else (0, 0)
    assert fewest <= len(resolved) <= most
    assert True not in resolved
    no_leaks(overlapped)


def test_a_step_workers_prelude_runs_before_the_job_is_reported_started():
    worker = StepWorker(torch.device("cpu"))
    order: list[str] = []
    done = worker.submit(lambda: order.append("job") or 7, prelude=lambda: order.append("prelude"))
    order.append("submit returned")
    assert done.result(timeout=30) == 7
    assert order[0] == "prelude" and sorted(order[1:]) == ["job", "submit returned"]

    def broken() -> None:
        raise Fault("in the prelude")

    failed = worker.submit(lambda: order.append("never"), prelude=broken)  # returns: no hang
    assert isinstance(failed.exception(timeout=30), Fault) and "never" not in order
    assert worker.submit(lambda: 8).result(timeout=30) == 8  # the worker goes on
    worker.close()


def test_a_job_queued_behind_a_long_one_is_not_timed_out(monkeypatch):
    """The start timeout counts from when the worker takes a job: a step submitted behind a
    forward longer than the timeout (the worker-resolved path submits that early) still runs."""
    monkeypatch.setattr(step_worker, "START_TIMEOUT_S", 0.2)
    worker = StepWorker(torch.device("cpu"))
    release = threading.Event()
    first = worker.submit(lambda: release.wait(30) and 1)
    timer = threading.Timer(1.0, release.set)  # five start timeouts after the second is queued
    timer.start()
    second = worker.submit(lambda: 2)
    assert (first.result(timeout=30), second.result(timeout=30)) == (1, 2)
    timer.join()
    worker.close()


def test_an_interrupt_while_submitting_leaves_no_step_running(model_folders, monkeypatch):
    """A KeyboardInterrupt in the host while a worker-resolved step is being submitted: the step
    ahead of it and the step itself are waited for before their requests are failed and their
    blocks released, so no forward writes blocks the cache has handed on. The engine goes on."""
    eng = engine(model_folders["llama"], overlap=True)
    stepper = eng._overlap
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    batch = prompts(4, seed=12, low=6, high=20)
    for prompt in batch:
        eng.add_request(prompt, params)
    submit, submitted = stepper.worker.submit, []

    def interrupted(job, prelude=None):
        submitted.append(submit(job, prelude))
        if prelude is not None:  # the worker-resolved path
            raise KeyboardInterrupt
        return submitted[-1]

    monkeypatch.setattr(stepper.worker, "submit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(10):
            eng.step()
    assert submitted and all(f.done() for f in submitted)
    monkeypatch.setattr(stepper.worker, "submit", submit)
    no_leaks(eng)
    fresh = engine(model_folders["llama"], overlap=False).generate(batch, params)
    assert [o.token_ids for o in eng.generate(batch, params)] == [o.token_ids for o in fresh]
    no_leaks(eng)


def test_overlap_under_preemption_keeps_outputs_and_books(model_folders):
    batch = prompts(8, seed=2, low=20, high=40)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in engine(model_folders["llama"], overlap=False).generate(batch, params)]
    tight = engine(model_folders["llama"], overlap=True, kv_cache_memory="96KiB")
    assert [o.token_ids for o in tight.generate(batch, params)] == expected
    assert tight.metrics()["num_preemptions"] > 0
    no_leaks(tight)


@pytest.mark.parametrize(("at_step", "hits"), [(1, False), (3, True), (6, True)])
def test_aborts_while_a_step_is_in_flight_cache_only_computed_kv(model_folders, at_step, hits):
    """After one step, the first prefill is still in flight: the aborts find nothing computed
    and cache nothing; later they cache what earlier steps computed."""
    batch = prompts(6, seed=3, low=8, high=30)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eng = engine(model_folders["llama"], overlap=True)
    ids = [eng.add_request(p, params) for p in batch]
    for _ in range(at_step):
        eng.step()
    assert eng._overlap.in_flight is not None
    for rid in ids[::2]:
        eng.abort(rid)  # the step in flight still computes these
    eng.run_until(lambda: not eng.has_unfinished_requests())
    fresh = [o.token_ids for o in engine(model_folders["llama"], overlap=False).generate(batch, params)]
    for i, rid in enumerate(ids):
        out = eng.output(rid)
        if i % 2:
            assert out.token_ids == fresh[i]
        else:
            assert out.samples[0].finish_reason == "abort"
    # What the aborted requests cached is right: sent again, they hit it and give fresh outputs.
    again = eng.generate(batch[::2], params)
    assert [o.token_ids for o in again] == fresh[::2]
    assert (sum(o.num_cached_tokens for o in again) > 0) == hits
    no_leaks(eng)


@pytest.mark.parametrize("at_call", [1, 2, 5])
def test_a_failed_forward_fails_its_step_only(model_folders, monkeypatch, at_call):
    """Greedy requests: the step behind the failed one was submitted before it failed, and the
    worker wrote a harmless token in the places of its tokens."""
    resolved = count_worker_resolutions(monkeypatch)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    requests = [(p, params) for p in prompts(6, seed=4)]
    eng = engine(model_folders["llama"], overlap=True, max_num_seqs=3)
    execute, calls, flights = eng.runner.execute, [], []

    def faulty(step):
        calls.append(1)
        if len(calls) == at_call:
            raise Fault("injected")
        return execute(step)

    def watch(core):
        flights.append(core._overlap.in_flight)

    eng.runner.execute = faulty
    eng.step_hooks.append(watch)
    ids = [eng.add_request(p, params) for p, params in requests]
    eng.run_until(lambda: not eng.has_unfinished_requests())
    failed_flight = flights[at_call - 1]  # the step submitted as call `at_call`
    failed_batch = {item.request.request_id for item in failed_flight.batch}
    prompts_ = [prompt for prompt, _ in requests]
    fresh = [o.token_ids for o in engine(model_folders["llama"], overlap=False).generate(prompts_, params)]
    for rid, expected in zip(ids, fresh, strict=True):
        if rid in failed_batch:
            with pytest.raises(RequestError) as info:
                eng.output(rid)
            assert isinstance(info.value.__cause__, Fault)
        else:
            assert eng.output(rid).token_ids == expected
    assert failed_batch and len(failed_batch) < len(ids)
    assert True in resolved
    no_leaks(eng)
    # The failure cached nothing uncomputed: the failed prompts, sent again, give fresh outputs.
    again = [i for i, rid in enumerate(ids) if rid in failed_batch]
    outputs = eng.generate([prompts_[i] for i in again], params)
    assert [o.token_ids for o in outputs] == [fresh[i] for i in again]


def test_close_with_a_step_in_flight_then_later_requests_fail_at_once(model_folders):
    eng = engine(model_folders["llama"], overlap=True)
    eng.add_request(prompts(1, seed=5)[0], GREEDY)
    eng.step()
    assert eng._overlap.in_flight is not None
    eng.close()  # waits for the step in flight, then aborts its request
    rid = eng.add_request(prompts(1, seed=6)[0], GREEDY)
    eng.step()
    with pytest.raises(RequestError):
        eng.output(rid)
