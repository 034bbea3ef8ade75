"""Every tensor a step makes is made on the engine's device, never on torch's default one.

Steps run with torch's default device set to `meta`: a tensor created without naming its device
(the bug that breaks a CUDA engine, whose CPU-made tensors then meet CUDA ones) becomes a meta
tensor, which cannot be computed with or copied out, so the step fails. Host staging buffers name
the CPU explicitly, as they must.
"""

from __future__ import annotations

import torch

from radixkv import BeamSearchParams, Engine, SamplingParams


def test_generate_and_beam_search_steps_make_no_tensor_on_the_default_device(model_folders):
    folder = model_folders["llama"]
    engine = Engine.from_pretrained(folder, block_size=4, kv_cache_memory="4MiB", device="cpu")
    shared = list(range(40, 60))
    ids = [
        engine.add_request(shared + [1, 2, 3], SamplingParams(max_tokens=6, temperature=0.0)),
        engine.add_request(shared + [7], SamplingParams(max_tokens=6, temperature=0.9, top_p=0.8, seed=3)),
        engine.add_request(shared + [5, 6], SamplingParams(max_tokens=5, n=2, temperature=0.7, top_k=5)),
        engine.add_request(shared + [9, 9], BeamSearchParams(beam_width=3, max_tokens=5)),
    ]
    with torch.device("meta"):
        assert torch.empty(1).device.type == "meta"  # the trap is set
        engine.run_until(lambda: all(engine.is_finished(i) for i in ids))
    outs = [engine.output(i) for i in ids[:3]]
    assert [len(o.token_ids) for o in outs] == [6, 6, 5]
    assert len(engine.beam_output(ids[3])) == 3
    engine.check_invariants()
