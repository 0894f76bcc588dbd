"""Timeline picture of a simulated schedule, in the manner of the PTD-P paper's Figure 4.

Owns only drawing: one row per rank, forwards blue and backwards green (darker for the
first chunk, lighter for later ones), the microbatch number in each box. matplotlib is
imported here lazily so that schedules.py and its CLI run without it.
"""
from __future__ import annotations

_FORWARD = ("#1f4e9c", "#6f9be0")  # first chunk, later chunks
_BACKWARD = ("#1d7a3a", "#79c98f")


def draw_timeline(stats, schedule, path: str) -> None:
    """Writes the per-rank timeline of `stats` (from simulate(schedule)) to `path`.

    Raises: ImportError with an install hint when matplotlib is missing.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only; no display on cluster nodes
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("matplotlib is not installed (pip install matplotlib)") from e
    p = schedule.stages
    fig, ax = plt.subplots(figsize=(max(6.0, stats.total_time * 0.35), 0.5 * p + 1.2))
    for r, row in enumerate(stats.timeline):
        for start, end, action in row:
            colours = _FORWARD if action.kind == "F" else _BACKWARD
            ax.add_patch(plt.Rectangle((start, p - 1 - r), end - start, 0.9, edgecolor="black",
                                       facecolor=colours[min(action.chunk, 1)], linewidth=0.5))
            ax.text((start + end) / 2, p - 1 - r + 0.45, str(action.microbatch), ha="center",
                    va="center", fontsize=7, color="white" if action.chunk == 0 else "black")
    ax.set_xlim(0, stats.total_time)
    ax.set_ylim(-0.1, p)
    ax.set_yticks([p - 1 - r + 0.45 for r in range(p)])
    ax.set_yticklabels([f"rank {r}" for r in range(p)])
    ax.set_xlabel("time")
    ax.set_title(f"{schedule.kind}: p={p} v={schedule.chunks} m={schedule.microbatches}, "
                 f"bubble {stats.bubble_fraction:.3f}")
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
