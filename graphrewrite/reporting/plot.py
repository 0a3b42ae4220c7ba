"""Pictures of a step's memory, for people: modelled curves over the schedule (`inspect --plot`,
`optimize --plot`), measured ones over the step's time (`verify --plot`).

The x axis is the share of the step done (schedule position, or time since the step began), so
an original and its rewrite, whose schedules differ in length, share one chart. Drawn with
matplotlib, an optional extra (`pip install 'graphrewrite[plot]'`); the format follows the file's
extension (.png, .svg, .pdf).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..analysis.memory import MemoryReport
from ..core import io
from ..core.errors import GraphRewriteError

__all__ = ["tradeoff", "MIB", "FORMATS", "LABELLED", "Curve", "modelled", "measured", "gradient_flow", "check",
           "draw"]

MIB = 2**20
FORMATS = (".png", ".svg", ".pdf")
LABELLED = 3  # largest tensors named at a modelled peak


@dataclass
class Curve:
    label: str
    shares: list[float]          # 0..1: how far through the step
    mib: list[float]
    boundary: float | None = None  # where back-propagation starts
    notes: list[str] = field(default_factory=list)  # said at the curve's peak
    dashed: bool = False


def modelled(report: MemoryReport, label: str, flow=frozenset()) -> list[Curve]:
    """The allocator's and the live tensors' curves of a simulated step; the live tensors'
    peak labelled with the largest of them, the forward/backward boundary (where the gradient
    `flow` starts to run) marked."""
    steps = max(1, len(report.order) - 1)
    shares = [i / steps for i in range(len(report.order))]
    # Grappler renames and rewires a few nodes, so a node of the written graph's flow may run
    # early in the graph as run: the boundary is where 2% of the flow has run.
    positions = [i for i, n in enumerate(report.order) if n in flow]
    boundary = positions[len(positions) // 50] / steps if positions else None
    notes = [f"{ref} {size / MIB:.1f} MiB" for ref, size in
             report.live_at_peak.get("device", [])[:LABELLED]]
    return [Curve(f"{label} (allocator)", shares, [b / MIB for b in report.allocated_timeline()],
                  boundary),
            Curve(f"{label} (live tensors)", shares, [b / MIB for b in report.timeline],
                  notes=notes, dashed=True)]


def measured(timeline: list[tuple[float, int]], label: str) -> Curve:
    """A traced step's `allocator_bytes_in_use` over its time (microseconds, bytes)."""
    if not timeline:
        return Curve(label, [], [])
    start, end = timeline[0][0], max(timeline[-1][0], timeline[0][0] + 1)
    return Curve(label, [(t - start) / (end - start) for t, _ in timeline],
                 [b / MIB for _, b in timeline])


def gradient_flow(graph, split) -> frozenset:
    """The gradient flow's nodes that read a forward value: the first of them to run is where
    back-propagation starts in a schedule (the seed and what only shapes feed run earlier)."""
    flow = split.gradient_flow
    forward = split.forward
    return frozenset(n for n in flow
                     if any(r.node in forward and r.node not in flow and
                            graph.op(r.node) not in ("Const", "Shape", "ShapeN")
                            for r in graph.data_inputs(n)))


def check(path) -> None:
    """Refuse a chart that could not be drawn (its format, matplotlib missing): the commands
    call it before they run, so nothing is written for a plot that would fail at the end."""
    if Path(path).suffix.lower() not in FORMATS:
        raise GraphRewriteError(f"${{plot}} {path}: the extension picks the format; use one of "
                                f"{', '.join(FORMATS)}")
    _pyplot()


def draw(path, curves: list[Curve], title: str) -> Path:
    """Draw `curves` on one chart and write it to `path` atomically."""
    path = Path(path)
    check(path)
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(10, 5))
    boundaries = 0
    for curve in curves:
        if not curve.shares:
            continue
        line, = axes.plot(curve.shares, curve.mib, label=curve.label, linewidth=1.2,
                          linestyle="--" if curve.dashed else "-")
        if curve.boundary is not None:  # labels stacked, so two close boundaries stay legible
            axes.axvline(curve.boundary, color=line.get_color(), linestyle=":", linewidth=1)
            axes.annotate("backward", (curve.boundary, 0), xytext=(3, 3 + 10 * boundaries),
                          textcoords="offset points", color=line.get_color(), fontsize=8)
            boundaries += 1
        top = max(range(len(curve.mib)), key=curve.mib.__getitem__)
        # A solid (allocator) curve's peak is labelled above it, a dashed (live tensors) one's
        # below it with its largest tensors: the two peaks of one graph are close.
        text = f"peak {curve.mib[top]:.1f} MiB" + (
            "".join(f"\n{n}" for n in curve.notes) if curve.dashed else "")
        axes.annotate(text, (curve.shares[top], curve.mib[top]),
                      xytext=(6, -6 if curve.dashed else 4), textcoords="offset points",
                      fontsize=7, va="top" if curve.dashed else "bottom",
                      color=line.get_color())
    axes.set_xlabel("share of the step done (schedule position or time)")
    axes.set_ylabel("device memory (MiB)")
    axes.set_title(title, fontsize=10)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="upper left")
    figure.tight_layout()
    data = _render(figure, path.suffix.lower()[1:])
    pyplot.close(figure)
    io.write_atomic(path, data)
    return path


def tradeoff(path, found: dict, title: str) -> Path:
    """The trade-off curve (`pipeline.tradeoff.curve`): modelled peak against extra step time,
    a line per planner, written to `path` atomically."""
    path = Path(path)
    check(path)
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(7, 5))
    labels = {"estimate": "estimate (as written)", "exact": "exact (as written)",
              "levers": "every lever, lossy ones too (as run)"}
    for planner, label in labels.items():
        points = sorted(found.get(planner, []), key=lambda p: p["extra_seconds"])
        if points:
            axes.plot([p["extra_seconds"] * 1000 for p in points],
                      [p["peak_bytes"] / 2**20 for p in points], marker="o", label=label)
    axes.axhline(found["original_peak_bytes"] / 2**20, color="grey", linestyle=":",
                 label="original")
    axes.set_xlabel(f"extra step time, ms, modelled on profile {found['profile']}")
    axes.set_ylabel("modelled peak (MiB)")
    axes.set_title(title, fontsize=10)
    axes.set_ylim(bottom=0)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    data = _render(figure, path.suffix.lower()[1:])
    pyplot.close(figure)
    io.write_atomic(path, data)
    return path


def _render(figure, fmt: str) -> bytes:
    import io as bytes_io

    buffer = bytes_io.BytesIO()
    figure.savefig(buffer, format=fmt, dpi=120)
    return buffer.getvalue()


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise GraphRewriteError("${plot} needs matplotlib: pip install 'graphrewrite[plot]'") \
            from None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot
