"""The dashboard's page and the offline reports as self-contained HTML: the package's static
files (`static/`) inlined into one document, so that nothing is fetched from anywhere but the
server's own `/dashboard/data` (users run it offline; the page's CSP forbids anything else)."""

from __future__ import annotations

import html
import json
import re
from functools import cache
from importlib import resources
from typing import Any

CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
)
"""The dashboard's Content-Security-Policy: its inline code, and requests to its own origin only."""


@cache
def static(name: str) -> str:
    """The text of `radixkv/dashboard/static/<name>`."""
    return resources.files("radixkv.dashboard").joinpath("static", name).read_text(encoding="utf-8")


def fill(template: str, **parts: str) -> str:
    """`template` with each `{{name}}` replaced by `parts[name]`, in one pass: what is put in is
    never searched again, so data that spells `{{name}}` stays as it is."""
    return re.sub(r"\{\{(\w+)\}\}", lambda m: parts[m.group(1)], template)


def dashboard_page(poll_ms: int) -> str:
    """The live page, polling every `poll_ms`."""
    return fill(
        static("dashboard.html"),
        style=static("style.css"),
        poll_ms=str(int(poll_ms)),
        charts=static("charts.js"),
        dashboard=static("dashboard.js"),
    )


def report_page(data: dict[str, Any]) -> str:
    """An offline report: `data` is `{title, subtitle, tables, figures}` as `static/report.js`
    draws them (figures `{title, kind: "line" | "bars", series | rows, opts, note, wide}`, tables
    `{title, columns, rows}`). One file that opens anywhere, with no server."""
    return fill(
        static("report.html"),
        title=html.escape(data["title"]),
        style=static("style.css"),
        data=script_json(data),
        charts=static("charts.js"),
        report=static("report.js"),
    )


def script_json(data: Any) -> str:
    """`data` as JSON that is safe inside a `<script>` element (no `</script>` can end it early)."""
    return json.dumps(data).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
