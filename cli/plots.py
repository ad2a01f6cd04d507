"""Plots for `gpuq stats --plot`, drawn with matplotlib's Agg backend (no display needed), in the
format the file's suffix names (x.svg, x.pdf; PNG for a file without one).

Imported only when a plot is asked for: matplotlib takes a second to import.
"""

from __future__ import annotations

import os
from collections import defaultdict
from datetime import datetime
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from gpuq.service.errors import InvalidSpec

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Every plot is this size: 10 x 6 inches at 100 dots per inch, 1000 x 600 pixels.
FIGSIZE, DPI = (10, 6), 100


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_format(path: Path) -> str:
    """The format ``path``'s suffix names, as matplotlib calls it (``x.SVG``: svg; png for a name
    without a suffix). InvalidSpec (exit 2) for a suffix matplotlib cannot write: asked before
    anything is drawn, and no file is made."""
    suffix = path.suffix[1:].lower()
    if not suffix:
        return "png"
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if suffix not in formats:
        raise InvalidSpec(f"--plot {path}: cannot draw a .{suffix} file; name it .png, .svg, .pdf or another "
                          f"suffix matplotlib writes ({', '.join(sorted(formats))})")
    return suffix


def _save(fig: Figure, path: Path) -> None:
    there = os.path.exists(path)  # False, not PermissionError, in a folder the user cannot search
    try:
        fig.savefig(path, dpi=DPI, format=plot_format(path))
    except OSError as exc:
        raise InvalidSpec(f"cannot write the plot to {path}: {exc.strerror or exc}") from None
    except RuntimeError as exc:  # a format that needs a program missing here: .pgf without LaTeX
        if not there:
            path.unlink(missing_ok=True)
        raise InvalidSpec(f"cannot write the plot to {path}: {exc}") from None
    finally:
        _pyplot().close(fig)


def job_plot(series: list[dict[str, Any]], path: Path, title: str, names: dict[int, str] | None = None) -> None:
    """A job's utilisation (%), memory (MiB) and power (W) over time, one line per GPU, named by
    ``names`` (a sample's ``gpu_id`` is its GPU's row, not its index on the node)."""
    plt = _pyplot()
    fig, axes = plt.subplots(3, 1, figsize=FIGSIZE, sharex=True)
    by_gpu: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for p in series:
        by_gpu[p["gpu_id"]].append(p)
    for ax, key, label in zip(axes, ("utilization", "memory_used_mib", "power_w"),
                              ("utilisation %", "memory MiB", "power W"), strict=True):
        for gpu_id, points in sorted(by_gpu.items()):
            ax.plot([p["at"] for p in points], [p[key] if p[key] is not None else float("nan") for p in points],
                    label=(names or {}).get(gpu_id, f"GPU {gpu_id}"))
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylim(0, 105)
    axes[0].set_title(title + ("" if series else ": no device samples"))
    if len(by_gpu) > 1:
        axes[0].legend(loc="upper right", fontsize="small")
    fig.autofmt_xdate()
    _save(fig, path)


def cluster_plot(edges: list[datetime], by_user: dict[str, list[float]], path: Path, title: str) -> None:
    """The GPUs kept busy over the period, stacked by user."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=FIGSIZE)
    users = sorted(by_user, key=lambda u: -sum(by_user[u]))
    if users:
        ax.stackplot(edges, *[by_user[u] for u in users], labels=users, alpha=0.85)
        ax.legend(loc="upper left", fontsize="small")
    ax.set_ylabel("busy GPUs (utilisation x GPUs)")
    ax.set_title(title + ("" if users else ": no device samples"))
    ax.grid(alpha=0.3)
    fig.autofmt_xdate()
    _save(fig, path)
