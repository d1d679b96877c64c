"""Pictures of a topology: one panel for a static graph, one per iteration of a period for a dynamic one.

matplotlib and networkx are imported here only, when a picture is asked
for; the figure is rendered with the Agg canvas directly, so no global
backend is switched and no display is needed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Protocol

import numpy as np

from bfexp.topology.mixing import SparseMixing

# More panels than this would be unreadable; the rest of a long period is left out (and said so).
MAX_PANELS = 36
# Above this many edges in a panel, edges are one collection of thin lines without arrows (said in the title):
# networkx draws each directed edge as its own arrow patch, and exp2's 49k at 4096 ranks took minutes.
MAX_ARROWS = 2000


class Drawable(Protocol):
    """What a picture reads of a topology (a bfexp.topology.Topology). Named here, not imported: base.Topology.draw
    imports this module, and nothing imports back."""

    size: int
    period: int
    weight_scheme: str

    @property
    def label(self) -> str: ...

    @property
    def is_dynamic(self) -> bool: ...

    def positions(self) -> np.ndarray: ...

    def sparse_matrix(self, t: int = 0) -> SparseMixing: ...

    def spectral_gap(self) -> float: ...


def draw(topology: Drawable, path: str | Path, *, max_panels: int = MAX_PANELS,
         spectral_gap: float | None = None) -> Path:
    """Draw W(t) for t in one period into an image file (format from the suffix, e.g. .png);
    ``spectral_gap`` for the title when the caller has computed it (else computed here)."""
    import networkx as nx
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    n = topology.size
    panels = min(topology.period, max_panels)
    cols = math.ceil(math.sqrt(panels))
    rows = math.ceil(panels / cols)
    side = max(2.5, min(5.0, 14.0 / cols))
    fig = Figure(figsize=(max(side * cols, 6.0), side * rows + 0.8))
    FigureCanvasAgg(fig)
    pos = {i: tuple(p) for i, p in enumerate(topology.positions())}
    node_size = float(np.clip(6000 / max(n, 1), 20, 400))
    plain = False  # a panel drew its edges as plain lines
    for t in range(panels):
        ax = fig.add_subplot(rows, cols, t + 1)
        m = topology.sparse_matrix(t)
        if len(m.values) > MAX_ARROWS:
            _draw_plain(ax, topology.positions(), m.senders, m.receivers, node_size)
            plain = True
            if topology.is_dynamic:
                ax.set_title(f"t = {t}", fontsize=10)
            continue
        edges = {(int(s), int(r)): float(w) for s, r, w in zip(m.senders, m.receivers, m.values)}
        two_way = [(s, r) for (s, r) in edges if s < r and (r, s) in edges]
        one_way = [(s, r) for (s, r) in edges if (r, s) not in edges]
        g = nx.DiGraph()
        g.add_nodes_from(range(n))
        g.add_edges_from(edges)
        nx.draw_networkx_nodes(g, pos, ax=ax, node_size=node_size, node_color="#9ecae1", edgecolors="#3182bd")
        if n <= 64:
            nx.draw_networkx_labels(g, pos, ax=ax, font_size=8 if n <= 32 else 6)
        nx.draw_networkx_edges(
            g, pos, ax=ax, edgelist=two_way, arrows=False, edge_color="#636363", width=_widths(edges, two_way)
        )
        nx.draw_networkx_edges(
            g,
            pos,
            ax=ax,
            edgelist=one_way,
            arrows=True,
            arrowstyle="-|>",
            arrowsize=10,
            node_size=node_size,
            edge_color="#de2d26",
            width=_widths(edges, one_way),
            connectionstyle="arc3,rad=0.08",
        )
        if topology.is_dynamic:
            ax.set_title(f"t = {t}", fontsize=10)
        ax.set_axis_off()
        ax.set_aspect("equal")
    more = f" (first {panels} of {topology.period} shown)" if panels < topology.period else ""
    kind = f"dynamic, period {topology.period}{more}" if topology.is_dynamic else "static"
    lines = f"\nover {MAX_ARROWS} edges a panel: edges as plain lines (no arrows, no weights)" if plain else ""
    fig.suptitle(
        f"{topology.label}\n{n} ranks, weights={topology.weight_scheme}, {kind}, "
        f"spectral gap {topology.spectral_gap() if spectral_gap is None else spectral_gap:.4f}{lines}",
        fontsize=11,
    )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def _draw_plain(ax: object, xy: np.ndarray, senders: np.ndarray, receivers: np.ndarray, node_size: float) -> None:
    """Every edge as one thin line of one collection and the ranks as one scatter: fast at any size."""
    from matplotlib.collections import LineCollection

    segments = np.stack([xy[senders], xy[receivers]], axis=1)  # (edges, 2 ends, 2 coordinates)
    ax.add_collection(LineCollection(segments, colors="#636363", linewidths=0.2, alpha=0.3))
    ax.scatter(xy[:, 0], xy[:, 1], s=node_size, c="#9ecae1", edgecolors="#3182bd", linewidths=0.3, zorder=2)
    ax.set_axis_off()
    ax.set_aspect("equal")
    ax.autoscale_view()


def _widths(weights: dict[tuple[int, int], float], edges: list[tuple[int, int]]) -> list[float]:
    """Thicker lines for larger weights, so uneven weighting shows."""
    return [0.6 + 3.0 * weights[e] for e in edges]
