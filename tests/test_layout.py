"""The installed layout: one import name, `radixkv`, and the cache and CLI free of torch.

Run in a subprocess outside the repository folder, so that nothing in the checkout can be found
through the working directory: what is checked is what `pip install` made. The engine's own
children start without the working directory on their path.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from radixkv.engine.process.launcher import Launcher

HEAVY = ("torch", "transformers", "triton")
ROOT = Path(__file__).resolve().parents[1]


def run_in(cwd, code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def run_outside(tmp_path, code: str) -> str:
    return run_in(tmp_path, code)


def test_no_top_level_kernels_or_scheduler_module(tmp_path):
    """Both names belong to other published packages: radixkv's distribution provides only
    `radixkv` (Hugging Face's `kernels`, which transformers 5.25 and later install, may be there)."""
    out = run_outside(
        tmp_path,
        """
        import importlib.metadata, json
        provided = importlib.metadata.packages_distributions()
        print(json.dumps({name: provided.get(name, []) for name in ("radixkv", "kernels", "scheduler")}))
        """,
    )
    provided = json.loads(out)
    assert provided["radixkv"] == ["radixkv"]
    assert "radixkv" not in provided["kernels"] and "radixkv" not in provided["scheduler"]


def test_a_checkout_first_on_sys_path_shadows_no_other_package():
    """In the repository's root with the root first on `sys.path` (as `python -m`, `python -c`
    and pytest put it), `kernels` and `scheduler` are absent or found outside the checkout (the
    virtual environment excepted, which may sit inside it): transformers 5.25 and later import
    Hugging Face's `kernels` when they build a model, so a folder of that name at the root would
    break them. radixkv's own kernels and scheduler are found inside the radixkv package."""
    out = run_in(
        ROOT,
        f"""
        import importlib.util, json, sys, sysconfig
        sys.path.insert(0, {str(ROOT)!r})
        import radixkv, radixkv.kernels, radixkv.scheduler
        found = {{}}
        for name in ("kernels", "scheduler"):
            spec = importlib.util.find_spec(name)
            found[name] = [] if spec is None else [spec.origin, *(spec.submodule_search_locations or [])]
        print(json.dumps({{
            "found": found,
            "site": [sysconfig.get_paths()[key] for key in ("purelib", "platlib")],
            "radixkv": radixkv.__path__[0],
            "own": [radixkv.kernels.__file__, radixkv.scheduler.__file__],
        }}))
        """,
    )
    result = json.loads(out)
    site = [Path(path).resolve() for path in result["site"]]
    for name, locations in result["found"].items():
        for location in filter(None, locations):
            path = Path(location).resolve()
            in_checkout = path.is_relative_to(ROOT) and not any(path.is_relative_to(s) for s in site)
            assert not in_checkout, f"`import {name}` finds {path}, inside the checkout"
    package = Path(result["radixkv"]).resolve()
    assert [Path(own).resolve().parent.parent for own in result["own"]] == [package, package]


def test_kernels_and_scheduler_import_inside_radixkv(tmp_path):
    out = run_outside(
        tmp_path,
        """
        from radixkv.kernels import copy_blocks, paged_attention, store_kv
        from radixkv.scheduler.scheduler import Scheduler
        print(paged_attention.__module__, Scheduler.__module__)
        """,
    )
    assert out.split() == ["radixkv.kernels.paged_attention", "radixkv.scheduler.scheduler"]


def test_cache_imports_without_torch_transformers_or_triton(tmp_path):
    out = run_outside(
        tmp_path,
        f"""
        import sys
        from radixkv.cache import BlockPool, KVCacheManager, RadixCache, make_policy
        pool = BlockPool(8, 4)
        kv = KVCacheManager(pool, RadixCache(pool, make_policy("lru")))
        kv.release(kv.admit([1, 2, 3, 4, 5]))
        print([m for m in {HEAVY!r} if m in sys.modules])
        """,
    )
    assert out.strip() == "[]"


def test_help_simulate_and_workload_load_no_heavy_module(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]}\n' * 2)
    out = run_outside(
        tmp_path,
        f"""
        import contextlib, io, sys
        from radixkv.cli import main
        for argv in (
            ["--help"],
            ["bench", "--help"],
            ["serve", "--help"],
            ["workload", "gen", "chat", "--help"],
            ["simulate", "trace.jsonl", "--hash-block", "4", "--block-size", "4", "--capacity-blocks", "8"],
            ["simulate", "trace.jsonl", "--hash-block", "4", "--capacity-blocks", "8", "--replicas", "2"],
        ):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
                main(argv)
        print([m for m in {HEAVY!r} if m in sys.modules])
        """,
    )
    assert out.strip() == "[]"


def test_console_script_help_runs(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "radixkv.cli", "--help"], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 0 and "replay" in result.stdout


@pytest.mark.skipif(sys.version_info < (3, 11), reason="python -P is Python 3.11's")
def test_the_core_launcher_ignores_packages_in_the_working_directory(tmp_path, monkeypatch):
    """A launcher started in a folder that holds packages named as ones it imports (a user's
    folder may hold a `kernels/`, which transformers 5.25 imports as Hugging Face's) imports the
    installed ones: it imports the engine before it reads a request, so at EOF it exits 0, and 1 with a
    traceback had it imported the folder's `radixkv` or `transformers`."""
    for name in ("radixkv", "transformers"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise ImportError('{name} from the folder')\n")
    monkeypatch.chdir(tmp_path)
    launcher = Launcher()
    try:
        launcher.process.stdin.close()
        assert launcher.process.wait(timeout=300) == 0
    finally:
        launcher.process.kill()
        launcher.process.wait()
        launcher._reader.join(timeout=30)
