"""`replay --report-html` and `simulate --report-html`: one self-contained page whose figures
carry the same numbers as the run's JSON report, and that no data can break out of."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_replay import replay_args, workload  # noqa: F401  (a fixture)

from radixkv.cli import main
from radixkv.dashboard.page import report_page

DATA = re.compile(r'<script type="application/json" id="report-data">(.*?)</script>', re.S)


def embedded(path: Path) -> dict:
    """The page's data, read back as the browser reads it (`JSON.parse` of the element's text)."""
    text = path.read_text()
    assert re.findall(r"""(?:src|href)\s*=\s*["'](?!data:)""", text) == []  # nothing fetched
    return json.loads(DATA.search(text).group(1))


def figure(data: dict, title: str) -> dict:
    return next(f for f in data["figures"] if f["title"] == title)


def test_replay_report_html_carries_the_reports_numbers(model_folders, workload, tmp_path, capsys):  # noqa: F811
    page, report_path = tmp_path / "replay.html", tmp_path / "replay.json"
    args = replay_args(workload, model_folders, "--report", str(report_path), "--report-html", str(page))
    assert main([*args, "--json"]) == 0
    report = json.loads(report_path.read_text())
    data = embedded(page)
    runs = report["runs"]
    cdf = figure(data, "TTFT distribution")["series"]
    assert [s["name"] for s in cdf] == list(runs)
    for s in cdf:
        ttft = [x for x, _ in s["points"]]
        assert len(ttft) == runs[s["name"]]["requests"] and ttft == sorted(ttft)
        assert s["points"][-1][1] == 1.0
    hits = {s["name"]: s for s in figure(data, "Prompt tokens found in the cache")["series"]}
    for name, run in runs.items():
        assert hits[f"{name}, cumulative"]["points"][-1][1] == pytest.approx(run["hit_rate"])
    table = data["tables"][0]
    assert table["columns"][1:] == list(runs)
    row = next(r for r in table["rows"] if r[0] == "TTFT p50 (s)")
    assert row[1:] == [runs[n]["ttft_s"]["p50"] for n in runs]


def hash_trace(path: Path) -> Path:
    rows = [
        {"timestamp": 10 * i, "input_length": 16, "output_length": 2, "hash_ids": [0, 1, i % 5 + 2, 100 + i]}
        for i in range(40)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("replicas", [None, 2])
def test_simulate_report_html_plots_the_json_rows(tmp_path, capsys, replicas):
    trace, page = hash_trace(tmp_path / "trace.jsonl"), tmp_path / "simulate.html"
    args = ["simulate", str(trace), "--capacity-blocks", "4,8,16", "--hash-block", "4", "--block-size", "4"]
    args += ["--eviction", "lru,adaptive", "--report-html", str(page), "--json"]
    if replicas:
        args += ["--replicas", str(replicas)]
    assert main(args) == 0
    rows = json.loads(capsys.readouterr().out)
    data = embedded(page)
    curves = {s["name"]: s["points"] for s in figure(data, "Hit rate against capacity")["series"]}
    for row in rows:
        name = f"{row['router']}, {row['eviction']}" if replicas else row["eviction"]
        assert [row["capacity_blocks"], row["hit_rate"]] in curves[name]
    assert len(data["tables"][0]["rows"]) == len(rows) == 6
    titles = [f["title"] for f in data["figures"]]
    assert ("The settings adaptive chose" in titles) == (replicas is None)


def test_no_data_breaks_out_of_the_page():
    hostile = "</script><script>alert(1)</script>{{charts}}<!--"
    text = report_page({"title": hostile, "subtitle": hostile, "tables": [], "figures": []})
    assert "<script>alert(1)" not in text
    assert "{{charts}}&lt;!--</title>" in text and text.count("const RK =") == 1  # left as it was
    assert json.loads(DATA.search(text).group(1))["subtitle"] == hostile
    assert text.count("</script>") == 3  # the data's, the charts' and the report's elements
