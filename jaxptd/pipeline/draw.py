"""Timeline picture of a simulated schedule, in the manner of the PTD-P paper's Figure 4.

Owns only drawing: one row per rank, forwards blue, backwards (input gradients, for zero-
bubble kinds) green and weight gradients orange (darker for the first chunk, lighter for
later ones, as the legend says), the microbatch number in each box. A long schedule (over WINDOW time units) is drawn as its first and last WINDOW / 2
units side by side, so boxes stay readable; the steady state between them repeats.
matplotlib is imported here lazily so that the schedules and their CLI run without it.
"""
from __future__ import annotations

_COLOURS = {"F": ("#1f4e9c", "#6f9be0"),  # first chunk, later chunks
            "B": ("#1d7a3a", "#79c98f"),
            "W": ("#b35806", "#f1a340")}
_NAMES = {"F": "forward", "B": "backward", "W": "weight gradients"}


WINDOW = 80  # time units drawn in full


def _panel(ax, stats, p: int, start: float, end: float) -> None:
    """The boxes of `stats` that fall in [start, end) on one axis."""
    import matplotlib.pyplot as plt
    for r, row in enumerate(stats.timeline):
        for begin, finish, action in row:
            if finish <= start or begin >= end:
                continue
            colours = _COLOURS[action.kind]
            ax.add_patch(plt.Rectangle((begin, p - 1 - r), finish - begin, 0.9,
                                       edgecolor="black", linewidth=0.5,
                                       facecolor=colours[min(action.chunk, 1)]))
            ax.text((begin + finish) / 2, p - 1 - r + 0.45, str(action.microbatch),
                    ha="center", va="center", fontsize=7, clip_on=True,
                    color="white" if action.chunk == 0 else "black")
    ax.set_xlim(start, end)
    ax.set_ylim(-0.1, p)
    ax.set_xlabel("time")


def draw_timeline(stats, schedule, path: str) -> None:
    """Writes the per-rank timeline of `stats` (from simulate(schedule)) to `path`.

    Raises: ImportError with an install hint when matplotlib is missing.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only; no display on cluster nodes
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as e:
        raise ImportError("matplotlib is not installed (pip install matplotlib)") from e
    p, total = schedule.stages, stats.total_time
    spans = [(0, total)] if total <= WINDOW else [(0, WINDOW / 2), (total - WINDOW / 2, total)]
    width = sum(end - start for start, end in spans)
    fig, axes = plt.subplots(1, len(spans), squeeze=False, sharey=True,
                             figsize=(max(6.0, width * 0.35), 0.5 * p + 1.8))
    for ax, (start, end) in zip(axes[0], spans):
        _panel(ax, stats, p, start, end)
    axes[0][0].set_yticks([p - 1 - r + 0.45 for r in range(p)])
    axes[0][0].set_yticklabels([f"rank {r}" for r in range(p)])
    if len(spans) > 1:
        axes[0][0].set_title(f"first {WINDOW // 2} of {total:g} time units", fontsize=8)
        axes[0][1].set_title(f"last {WINDOW // 2}", fontsize=8)
    kinds = "FBW" if schedule.split_backward else "F" if schedule.forward_only else "FB"
    legend = [Patch(facecolor=_COLOURS[k][0], label=_NAMES[k]) for k in kinds]
    if schedule.chunks > 1:
        legend += [Patch(facecolor=_COLOURS[k][1], label=f"{_NAMES[k]}, later chunks")
                   for k in kinds]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=7,
               frameon=False)
    fig.suptitle(f"{schedule.kind}: p={p} v={schedule.chunks} m={schedule.microbatches}, "
                 f"bubble {stats.bubble_fraction:.3f} (numbers: microbatches)", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=150)
    plt.close(fig)
