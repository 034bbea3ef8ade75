"""`radixkv export MODEL DIR`: a preset (or any model radixkv loads) written as a Hugging Face
folder, so that tools which load models by path (transformers' `Auto*` classes, vLLM, lm-eval,
guidellm) take it as it is, offline.

The folder holds `config.json`, `generation_config.json`, the weights as safetensors and the
tokenizer with its chat template. A preset's weights are the ones radixkv itself draws for that
`--seed`, so `Engine.from_pretrained(DIR)` generates what `Engine(EngineConfig(model=PRESET))`
does. An existing folder that already holds a model is refused rather than overwritten.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def export_model(model: str, folder: str | Path, *, dtype: str = "auto", seed: int = 0) -> Path:
    """Writes `model` (a preset name or a folder) into `folder`; returns the folder. Raises
    ValueError if `folder` already holds a `config.json`."""
    from radixkv.model.loader import load_model  # torch: not loaded to parse the command line

    folder = Path(folder)
    if (folder / "config.json").exists():
        raise ValueError(f"{folder} already holds a model (config.json); choose an empty folder")
    loaded = load_model(model, dtype=dtype, device="cpu", seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    loaded.model.save_pretrained(folder)
    if loaded.tokenizer is not None:
        # The chat template inside tokenizer_config.json, where every transformers version reads it.
        loaded.tokenizer.save_pretrained(folder, save_jinja_files=False)
    return folder


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a preset name (tiny-llama, tiny-qwen2) or a model folder")
    parser.add_argument("folder", help="the folder to write (created; must not hold a model yet)")
    parser.add_argument(
        "--dtype", default="auto", help="weights dtype: auto (the model's), float32, float16, bfloat16"
    )
    parser.add_argument("--seed", type=int, default=0, help="a preset's weight seed (as EngineConfig.seed)")


def run(args: argparse.Namespace) -> int:
    folder = export_model(args.model, args.folder, dtype=args.dtype, seed=args.seed)
    print(f"wrote {args.model} to {folder}")
    return 0
