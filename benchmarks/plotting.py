"""Plot helpers shared by the benchmark scripts."""
from __future__ import annotations

import math


def grouped_bars(ax, categories: list[str], series: dict[str, list[float]], fontsize: int = 8) -> None:
    """One group of bars per category, one bar per series in each (NaN = no bar), with a legend."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        kept = [(j + i * width, v) for j, v in enumerate(values) if not math.isnan(v)]
        ax.bar([x for x, _ in kept], [v for _, v in kept], width, label=name)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(categories))], categories, fontsize=fontsize)
    if len(series) > 4:  # many series: beside the axes, where it hides no bar
        ax.legend(fontsize=fontsize, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.legend(fontsize=fontsize)


def save_figure(fig, path) -> None:
    """Lay out, write the PNG (folders made as needed) and say where it went."""
    from pathlib import Path

    path = Path(path)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")
