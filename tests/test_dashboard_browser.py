"""`/dashboard` in a real browser: headless Chromium (Debian's `chromium`, driven by Playwright)
against a `radixkv serve` process with two keys, each its own cache namespace.

What it checks, from outside: the tree view shows the system prompt that key A's chats share as
one node whose token count is what the tokenizer says the prompts share (cut to the tree's block
boundary); the hit-rate chart moves as traffic comes; key B's page shows none of A's tree; and
neither page logs a console error. Skips only when no Chromium can be had (`.ci/run` installs it).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from test_server import BLOCK, serve
from transformers import AutoTokenizer

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH (apt install chromium)"),
]
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SYSTEM = "You are the librarian of a radix tree. Answer in one short line, and cite the branch."
QUESTIONS = [["Which branch?", "Who planted it?"], ["Is it pruned?", "Why so deep?", "Any leaves?"]]
WAIT_S = 60
SCREENSHOT = os.environ.get("RADIXKV_DASHBOARD_SCREENSHOT")  # where to save one, for the docs


def shared_prefix_tokens(folder: Path) -> int:
    """Tokens every chat's prompt shares, cut to the block boundary where the tree's edges start."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [
        tokenizer.apply_chat_template(messages(q), add_generation_prompt=True, tokenize=False)
        for batch in QUESTIONS
        for q in batch
    ]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    shared = 0
    while all(len(i) > shared and i[shared] == ids[0][shared] for i in ids):
        shared += 1
    return shared - shared % BLOCK


def until(condition: Callable[[], bool], what: str) -> None:
    """Waits for `condition`, read through locators: the page's CSP forbids the `eval` that
    Playwright's `wait_for_function` needs, and the test keeps the CSP as users get it."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"the dashboard never showed {what}"
        time.sleep(0.1)


def open_page(browser, url: str, errors: list[str], **options):
    """A new page at `url` whose console errors and uncaught exceptions go into `errors`."""
    page = browser.new_page(**options)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def chat(url: str, key: str, questions: list[str]) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    for q in questions:
        client.chat.completions.create(model="tiny", messages=messages(q), max_tokens=3, temperature=0)


def test_dashboard_shows_a_keys_shared_prefix_live_and_nothing_to_another_key(model_folders, tmp_path):
    keys = ("key-a", "key-b")
    extra = ("--api-key", keys[0], "--api-key", keys[1], "--cache-isolation", "per-key")
    with serve(model_folders["llama"], tmp_path / "serve.log", "--served-model-name", "tiny", *extra) as (
        url,
        _,
    ):
        assert httpx.get(f"{url}/dashboard").status_code == 401
        assert httpx.get(f"{url}/dashboard/data", params={"key": "wrong"}).status_code == 401
        with playwright.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
            errors: list[str] = []
            pages = {}
            for key in keys:
                page = open_page(
                    browser, f"{url}/dashboard?key={key}", errors, viewport={"width": 1280, "height": 1500}
                )
                assert "key=" not in page.url  # the key leaves the address bar at once
                pages[key] = page
            a, b = pages[keys[0]], pages[keys[1]]
            hit_rate = a.locator("#hit-rate")
            until(lambda: int(hit_rate.get_attribute("data-points") or 0) > 0, "a hit-rate sample")

            chat(url, keys[0], QUESTIONS[0])
            shared = shared_prefix_tokens(model_folders["llama"])
            root_nodes = "#tree rect.node[data-start='0']"
            node = a.locator(root_nodes)
            until(
                lambda: node.count() == 1 and node.get_attribute("data-tokens") == str(shared),
                f"one node of {shared} tokens at the root",
            )
            assert node.get_attribute("data-tier") == "device"
            assert int(node.get_attribute("data-hits")) >= len(QUESTIONS[0]) - 1
            first_rate = hit_rate.get_attribute("data-last")
            assert first_rate != ""

            chat(url, keys[0], QUESTIONS[1])  # all hits on the shared prefix: the rate rises
            until(lambda: hit_rate.get_attribute("data-last") != first_rate, "the hit rate move")
            assert node.count() == 1 and node.get_attribute("data-tokens") == str(shared)
            branches = a.locator(f"#tree rect.node[data-start='{shared}']")
            questions = sum(map(len, QUESTIONS))
            until(lambda: branches.count() == questions, "a branch per question under the shared node")

            b.wait_for_timeout(1000)  # several of B's polls after all of A's traffic
            assert b.locator("#tree").get_attribute("data-nodes") == "0"
            assert b.locator("#namespaces").get_attribute("data-rows") == "0"
            assert node.get_attribute("data-id") not in b.content()
            assert b.locator("#scope").inner_text() == "your key's namespace"
            if SCREENSHOT:
                a.screenshot(path=SCREENSHOT, full_page=True)
            browser.close()
        assert errors == []


def test_offline_reports_draw_every_point_without_errors(tmp_path):
    """`--report-html` pages, opened from a file: each figure draws the points its data holds."""
    from test_report_html import embedded, hash_trace

    from radixkv.cli import main
    from radixkv.tools import report_html
    from radixkv.tools.replay_result import TurnRecord

    simulated = tmp_path / "simulate.html"
    trace = hash_trace(tmp_path / "trace.jsonl")
    args = ["simulate", str(trace), "--capacity-blocks", "4,8,16", "--hash-block", "4", "--block-size", "4"]
    assert main([*args, "--eviction", "lru,gdsf,adaptive", "--report-html", str(simulated)]) == 0
    records = [
        TurnRecord(f"s{i % 3}", i // 3, 0.1 * i, 0.1 * i + 0.05, 0.1 * i + 0.2, 40, 4 * i, 5)
        for i in range(9)
    ]
    report = {"workload": "w.jsonl", "model": "tiny", "runs": {}}
    replayed = tmp_path / "replay.html"
    report_html.write(replayed, report_html.replay_report(report, {"prefix_cache": records}))
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        for path in (simulated, replayed):
            errors: list[str] = []
            page = open_page(browser, path.as_uri(), errors)
            figures = embedded(path)["figures"]
            drawn = page.locator(".figure")
            assert drawn.count() == len(figures)
            for i, f in enumerate(figures):
                points = sum(1 for s in f["series"] for _, y in s["points"] if y is not None)
                assert drawn.nth(i).get_attribute("data-points") == str(points), f["title"]
            assert errors == [], path.name
        browser.close()
