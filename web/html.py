"""The dashboard's page frame and table helpers: escaped HTML, CSS in the page, no scripts."""

from __future__ import annotations

import json
from collections.abc import Collection
from datetime import datetime
from html import escape
from typing import Any

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#111;background:#fafafa}
header{background:#1d2733;color:#fff;padding:10px 24px;display:flex;gap:24px;align-items:baseline}
header a{color:#cfe3ff;text-decoration:none}header b{font-size:18px;color:#fff}
main{padding:12px 24px 40px}h1{font-size:20px;margin:8px 0}h2{font-size:16px;margin:22px 0 6px}
table{border-collapse:collapse;background:#fff;margin:4px 0 8px}
th,td{padding:4px 10px;border-bottom:1px solid #e3e3e3;text-align:left;vertical-align:middle}
th{background:#f0f2f5;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
.state{padding:1px 7px;border-radius:9px;font-size:12px;background:#e9ecef}
.s-running,.s-busy{background:#d4f5dc}.s-succeeded{background:#b9ecc6}.s-pending{background:#d8ecff}
.s-dispatched{background:#e7ddff}.s-failed,.s-timed_out,.s-offline{background:#ffd6d6}
.s-cancelled,.s-drained{background:#fff0c2}.na{color:#888}.bar{vertical-align:middle}
pre{background:#fff;border:1px solid #e3e3e3;padding:8px;max-height:420px;overflow:auto;font-size:12px}
.facts th{width:130px;background:none;font-weight:600}.muted{color:#666;font-size:12px}
.chart{background:#fff;border:1px solid #e3e3e3;margin:4px 8px 8px 0}
"""


def page(title: str, body: str, refresh: int | None = None) -> str:
    """A whole page: the header's links, then ``body``; refreshed every ``refresh`` seconds if given."""
    meta = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">{meta}'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)} - gpuq</title><style>{CSS}</style></head><body>"
            '<header><b>gpuq</b><a href="/">queue and GPUs</a><a href="/history">history</a><a href="/usage">usage</a>'
            '<a href="/metrics">metrics</a></header>'
            f"<main>{body}</main></body></html>")


def table(headers: list[str], rows: list[list[str]], numeric: Collection[int] = frozenset(), cls: str = "") -> str:
    """A table of already-escaped cells; columns in ``numeric`` are right-aligned."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td class="num">{c}</td>' if i in numeric else f"<td>{c}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def facts(pairs: list[tuple[str, str]]) -> str:
    """A two-column table of label and already-escaped value."""
    return ('<table class="facts">' + "".join(f"<tr><th>{escape(k)}</th><td>{v}</td></tr>" for k, v in pairs)
            + "</table>")


def state(text: str) -> str:
    return f'<span class="state s-{escape(text.split()[0])}">{escape(text)}</span>'


def value(v: Any) -> str:
    """A result or parameter value: numbers rounded sensibly, structures as compact JSON."""
    if isinstance(v, bool) or v is None:
        return escape(str(v))
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e6 else f"{v:,.0f}"
    if isinstance(v, (dict, list)):
        return f"<code>{escape(json.dumps(v, default=str))}</code>"
    return escape(str(v))


def when(t: datetime | None) -> str:
    return escape(t.astimezone().strftime("%Y-%m-%d %H:%M:%S")) if t else "-"


def mib(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v / 1024:.1f} GiB" if v >= 1024 else f"{v:.0f} MiB"
