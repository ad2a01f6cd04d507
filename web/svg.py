"""Charts drawn on the server as inline SVG: a page needs no script and nothing from the network."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from html import escape

# One colour per series, in order; readable on white and for the common colour blindnesses.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf")


def bar(percent: float | None, label: str = "", width: int = 160, colour: str | None = None) -> str:
    """A horizontal bar filled to ``percent``, green/amber/red like `gpuq devices` unless ``colour``
    is given; ``n/a`` when unknown."""
    if percent is None:
        return '<span class="na">n/a</span>'
    p = max(0.0, min(float(percent), 100.0))
    colour = colour or ("#2ca02c" if p < 50 else "#e0a800" if p < 80 else "#d62728")
    text = escape(label or f"{p:.0f}%")
    return (f'<svg class="bar" width="{width}" height="16" role="img" aria-label="{text}">'
            f'<rect width="{width}" height="16" fill="#e9ecef" rx="3"/>'
            f'<rect width="{p / 100 * width:.1f}" height="16" fill="{colour}" rx="3"/>'
            f'<text x="6" y="12" font-size="11" fill="#111">{text}</text></svg>')


def line_chart(title: str, series: Mapping[str, Sequence[tuple[float, float | None]]], *, x_label: str = "",
               y_label: str = "", y_max: float | None = None, width: int = 640, height: int = 220) -> str:
    """Lines through each series' (x, y) points (those with a y), with axes, ticks and a legend; a note
    when empty."""
    points = [(x, y) for pts in series.values() for x, y in pts if y is not None]
    if not points:
        return f'<p class="na">{escape(title)}: no data</p>'
    left, right, top, bottom = 70, 12, 26, 34
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:
        x1 = x0 + 1
    y1 = y_max if y_max is not None else max(ys) * 1.1 or 1.0
    y0 = min(0.0, min(ys))
    sx = lambda x: left + (x - x0) / (x1 - x0) * (width - left - right)  # noqa: E731
    sy = lambda y: height - bottom - (y - y0) / (y1 - y0) * (height - top - bottom)  # noqa: E731
    out = [f'<svg class="chart" width="{width}" height="{height}" role="img" aria-label="{escape(title)}">',
           f'<text x="{left}" y="16" font-size="13" font-weight="bold">{escape(title)}</text>',
           f'<line x1="{left}" y1="{height - bottom}" x2="{width - right}" y2="{height - bottom}" stroke="#888"/>',
           f'<line x1="{left}" y1="{top}" x2="{left}" y2="{height - bottom}" stroke="#888"/>']
    for i in range(5):
        y = y0 + (y1 - y0) * i / 4
        out.append(f'<text x="{left - 4}" y="{sy(y) + 4:.1f}" font-size="10" text-anchor="end">{_num(y)}</text>'
                   f'<line x1="{left}" y1="{sy(y):.1f}" x2="{width - right}" y2="{sy(y):.1f}" stroke="#eee"/>')
    for i in range(5):
        x = x0 + (x1 - x0) * i / 4
        out.append(f'<text x="{sx(x):.1f}" y="{height - bottom + 14}" font-size="10" text-anchor="middle">'
                   f'{_num(x)}</text>')
    out.append(f'<text x="{(left + width - right) / 2}" y="{height - 4}" font-size="11" text-anchor="middle">'
               f'{escape(x_label)}</text>')
    out.append(f'<text x="12" y="{(top + height - bottom) / 2}" font-size="11" text-anchor="middle" '
               f'transform="rotate(-90 12 {(top + height - bottom) / 2})">{escape(y_label)}</text>')
    for n, (name, pts) in enumerate(series.items()):
        colour = PALETTE[n % len(PALETTE)]
        drawn = [(x, y) for x, y in pts if y is not None]
        if not drawn:
            continue
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in drawn)
        out.append(f'<polyline fill="none" stroke="{colour}" stroke-width="1.8" points="{path}"/>')
        if len(drawn) <= 40:
            out.extend(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.5" fill="{colour}"/>' for x, y in drawn)
        lx = width - right - 150
        out.append(f'<rect x="{lx}" y="{top + 4 + n * 15}" width="10" height="10" fill="{colour}"/>'
                   f'<text x="{lx + 14}" y="{top + 13 + n * 15}" font-size="11">{escape(name)}</text>')
    out.append("</svg>")
    return "".join(out)


def seconds_since(points: list[datetime], start: datetime) -> list[float]:
    return [(p - start).total_seconds() for p in points]


def _num(v: float) -> str:
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}"
