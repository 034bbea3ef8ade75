"""`radixkv bench model`: its arithmetic against an outside count, its measurement run end to end
at a tiny size on the CPU, and its refusal without a GPU. The real sizes run only on a GPU."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from radixkv import EngineConfig
from radixkv.cli import main
from radixkv.model.loader import ModelLoadError, load_model
from radixkv.tools.bench_model import ForwardCosts, Plan, measure_forwards


def test_forward_flops_equal_torchs_flop_count_of_a_plain_forward():
    loaded = load_model("tiny-llama", dtype="float32", device="cpu")
    loaded.model.set_attn_implementation("eager")  # QK and PV as plain matmuls over the whole square
    tokens = 24
    ids = torch.randint(0, 256, (1, tokens), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter, torch.inference_mode():
        loaded.model(input_ids=ids, use_cache=False, logits_to_keep=1)
    # The rotary angles are no work of the weights, and transformers 5.0 counts them (a small
    # matmul of frequencies by positions) where later releases do not (elementwise).
    counts = counter.get_flop_counts()
    rotary = sum(sum(ops.values()) for module, ops in counts.items() if module.endswith(".rotary_emb"))
    costs = ForwardCosts.of(loaded)
    # Eager attention multiplies every query with every key (masked after): tokens^2 keys a layer.
    square = 4 * costs.attention_width * tokens * tokens * loaded.num_layers
    causal = costs.forward_flops(loaded.num_layers, [(tokens, 0)], logit_rows=1)
    causal_attention = 4 * costs.attention_width * (tokens * (tokens + 1) // 2) * loaded.num_layers
    assert counter.get_total_flops() - rotary == causal - causal_attention + square


def test_forward_flops_count_the_keys_each_new_token_sees():
    loaded = load_model("tiny-llama", dtype="float32", device="cpu")
    costs = ForwardCosts.of(loaded)
    layers = loaded.num_layers
    base = costs.forward_flops(layers, [(1, 0)], logit_rows=0)
    # One decode token after 99 cached ones sees 100 keys; a 3-token extend after 10 sees 11+12+13.
    assert costs.forward_flops(layers, [(1, 99)], 0) - base == 4 * costs.attention_width * 99 * layers
    assert costs.forward_flops(layers, [(3, 10)], 0) == 3 * 2 * costs.linear_params + (
        4 * costs.attention_width * (11 + 12 + 13) * layers
    )


def test_weight_bytes_read_by_a_decode_step_skip_an_untied_embedding_table():
    llama, qwen = (load_model(name, dtype="float32", device="cpu") for name in ("tiny-llama", "tiny-qwen2"))
    for loaded, tied in ((llama, False), (qwen, True)):
        params = sum(p.numel() for p in loaded.model.parameters())
        table = loaded.model.get_input_embeddings().weight.numel()
        assert ForwardCosts.of(loaded).weight_bytes == 4 * (params - (0 if tied else table))


def test_the_measurement_runs_end_to_end_at_a_tiny_size():
    plan = Plan(prefill=((2, 40),), decode_batches=(3,), decode_context=48, repeats=1)
    config = EngineConfig(
        model="tiny-llama",
        device="cpu",
        kv_cache_memory="2MiB",
        max_model_len=64,
        max_num_seqs=4,
        max_num_batched_tokens=80,
        enable_prefix_cache=False,
    )
    result = measure_forwards(config, plan, peak_flops=1e12, peak_bytes_per_s=1e11)
    (prefill,), (decode,) = result["prefill"], result["decode"]
    assert (prefill["sequences"], prefill["tokens"], decode["batch"], decode["context"]) == (2, 40, 3, 48)
    assert prefill["tokens_per_s"] == pytest.approx(80 / (prefill["ms"] * 1e-3))
    assert 0 < prefill["mfu"] == pytest.approx(prefill["tflops"] * 1e12 / 1e12)
    assert 0 < decode["mbu"] == pytest.approx(decode["gb_per_s"] * 1e9 / 1e11)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_bench_model_refuses_clearly_without_a_gpu(capsys):
    assert main(["bench", "model"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err
    with pytest.raises(ModelLoadError, match="CUDA"):
        load_model("llama-3-8b-shape", dtype="auto", device="cpu")
