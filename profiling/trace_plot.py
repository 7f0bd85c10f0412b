"""Timeline pictures of Proton traces (CPU, matplotlib): per CTA one lane per sampled warp, the
whole span and a zoom on ~4 steps; one colour per scope in every picture."""
from __future__ import annotations

from collections.abc import Sequence

from profiling.trace_summary import WARPS_PER_GROUP, ScopeRoles, group_labels, middle

# Colours (tab10, then more) given to a family's scopes in its kernel order, so every picture of
# the family reads the same; a name the family lacks gets one of the extra colours.
_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")
_EXTRA_COLORS = ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94")


def scope_color(name: str, roles: ScopeRoles) -> str:
    order = roles.order
    if name in order:
        i = order.index(name)
        return (_COLORS + _EXTRA_COLORS)[i % (len(_COLORS) + len(_EXTRA_COLORS))]
    return _EXTRA_COLORS[sum(map(ord, name)) % len(_EXTRA_COLORS)]


def _zoom_window(evs: list[dict], t0: float, t1: float, step: str | None
                 ) -> tuple[float, float]:
    """A window of about 4 steps (starts of the `step` scope: the family's first gemm scope)
    around the middle of the CTA, else 1/16 of it."""
    starts = sorted(e["start"] for e in evs if e["name"] == step)
    if len(starts) > 8:
        ws = sorted({e["warp"] for e in evs if e["name"] == step})
        starts = sorted(e["start"] for e in evs if e["name"] == step and e["warp"] == ws[0])
    if len(starts) > 8:
        i = len(starts) // 2
        return starts[i] - 0.02 * (starts[i + 4] - starts[i]), starts[i + 4]
    mid, half = (t0 + t1) / 2, (t1 - t0) / 32
    return mid - half, mid + half


def _draw_cta(ax, evs: list[dict], t0: float, lanes: list[int], labels: dict[int, str],
              roles: ScopeRoles, window: tuple[float, float] | None = None) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator
    for lane, w in enumerate(lanes):
        by_name: dict[str, list[tuple[float, float]]] = {}
        for e in evs:
            if e["warp"] != w:
                continue
            if window and (e["end"] < window[0] or e["start"] > window[1]):
                continue
            by_name.setdefault(e["name"], []).append((e["start"] - t0, e["dur"]))
        for name, bars in by_name.items():
            ax.broken_barh(bars, (lane - 0.4, 0.8), facecolors=scope_color(name, roles),
                           edgecolor="none")
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([labels[w] for w in lanes], fontsize=7)
    ax.set_ylim(len(lanes) - 0.5, -0.5)
    if window:
        ax.set_xlim(window[0] - t0, window[1] - t0)
    ax.xaxis.set_major_locator(MaxNLocator(nbins=12 if window is None else 4))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / 1000:g}k" if x else "0"))
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(True, axis="x", alpha=0.3)


def plot_timelines(traces: Sequence[tuple[str, list[dict]]], png: str, max_ctas: int,
                   family: str) -> str:
    """One PNG: for each (title, events) up to max_ctas CTAs from the middle of the trace, stacked;
    each CTA gets its whole span (left; one common x scale when there are several traces) and a
    zoom on ~4 steps in its middle (right). One lane per sampled warp, labelled with its warp
    group (its role from `family`'s scopes); x in cycles from the CTA's first event."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    roles = ScopeRoles.of(family)
    step = roles.gemm[0] if roles.gemm else None
    panels = []  # (title, cta, events of the cta, lanes, labels)
    names: set[str] = set()
    for title, events in traces:
        if not events:
            raise ValueError(f"{title}: no scope events to plot")
        names.update(e["name"] for e in events)
        _, group_label = group_labels(events, roles)
        starts: dict[str, float] = {}
        for e in events:
            starts[e["cta"]] = min(starts.get(e["cta"], float("inf")), e["start"])
        ctas = middle(sorted(starts, key=lambda c: starts[c]), max_ctas)
        for cta in ctas:
            evs = [e for e in events if e["cta"] == cta]
            lanes = sorted({e["warp"] for e in evs})
            labels = {w: f"warp {w}  {group_label[w // WARPS_PER_GROUP]}" for w in lanes}
            panels.append((title, cta, evs, lanes, labels))
    heights = [0.6 + 0.28 * len(p[3]) for p in panels]
    fig, axes = plt.subplots(len(panels), 2, figsize=(15, sum(heights) + 1.2), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1], "height_ratios": heights})
    # several traces: one x scale for every whole-CTA panel, so lengths compare at a glance
    longest = max(max(e["end"] for e in p[2]) - min(e["start"] for e in p[2]) for p in panels)
    for (title, cta, evs, lanes, labels), (ax_full, ax_zoom) in zip(panels, axes):
        t0 = min(e["start"] for e in evs)
        t1 = max(e["end"] for e in evs)
        _draw_cta(ax_full, evs, t0, lanes, labels, roles)
        ax_full.set_xlim(0, longest if len(traces) > 1 else t1 - t0)
        ax_full.set_title(f"{title}: {cta} ({t1 - t0:,.0f} cycles)", fontsize=8, loc="left")
        win = _zoom_window(evs, t0, t1, step)
        _draw_cta(ax_zoom, evs, t0, lanes, labels, roles, window=win)
        ax_zoom.set_yticklabels([])
        ax_zoom.set_title("zoom: ~4 steps mid-CTA", fontsize=8, loc="left")
    for ax in axes[-1]:
        ax.set_xlabel("cycles since the CTA's first event (k = 1000)", fontsize=8)
    handles = [Patch(color=scope_color(n, roles), label=n) for n in roles.ordered(names)]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / (sum(heights) + 1.2)))
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def plot_timeline(events: list[dict], png: str, family: str, max_ctas: int = 4,
                  title: str = "") -> str:
    """Timeline of up to max_ctas CTAs of one trace (see plot_timelines)."""
    kernel = title or ", ".join(sorted({e["kernel"] for e in events})) or "trace"
    return plot_timelines([(kernel, events)], png, max_ctas, family)
