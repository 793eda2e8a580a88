"""The one length x depth heatmap that probe and compare reports draw."""

from __future__ import annotations

from pathlib import Path

__all__ = ["length_depth_heatmap"]


def length_depth_heatmap(
    path: Path,
    cells: dict[tuple[int, float], tuple[float | None, str]],
    *,
    cmap: str,
    vmin: float,
    vmax: float,
    label: str,
) -> None:
    """Write a PNG of ``cells`` ((length, depth) -> (value or None for no data, text in the cell))."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = sorted({n for n, _ in cells})
    depths = sorted({d for _, d in cells})
    grid = np.full((max(1, len(lengths)), max(1, len(depths))), np.nan)
    fig, ax = plt.subplots(figsize=(1.2 * max(3, len(depths)) + 2, 0.7 * max(3, len(lengths)) + 1.5))
    for (length, depth), (value, text) in cells.items():
        i, j = lengths.index(length), depths.index(depth)
        if value is not None:
            grid[i, j] = value
        ax.text(j, i, text, ha="center", va="center", fontsize=7)
    im = ax.imshow(grid, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", origin="lower")
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("needle depth (%)")
    ax.set_ylabel("length (tokens)")
    fig.colorbar(im, ax=ax, label=label)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
