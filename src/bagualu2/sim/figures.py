"""The PNG plots of docs/reproduction.md, from a :class:`~.reproduce.Report` (matplotlib, Agg; imported lazily
so the simulator never needs it)."""

from __future__ import annotations

from ..fusion.gantt import png_bytes
from .policies import ABLATION
from .reproduce import Report

FIG9_POLICIES = ("flexible", "kwai", "adapipe", "ideal")


def _figure(width: float, height: float):
    from matplotlib.figure import Figure  # lazy: no pyplot, no global backend state

    return Figure(figsize=(width, height), dpi=100)


def _bars(axes, labels, series: dict[str, list[float]], ylabel: str) -> None:
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        axes.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))], values, width, label=name)
    axes.set_xticks(range(len(labels)), labels, fontsize=8, rotation=15)
    axes.set_ylabel(ylabel)


def fig8(report: Report) -> bytes:
    runs = [r for r in report.scales if r.label in report.config.models]
    policies = [p for p in runs[0].results if p != "oracle"]
    figure = _figure(11, 6)
    top, bottom = figure.subplots(2, 1)
    labels = [f"{r.label}\n{r.gpus} GPUs" for r in runs]
    _bars(top, labels, {p: [r.tflops(p) / 1e3 for r in runs] for p in policies}, "PFLOP/s (total)")
    top.set_yscale("log")
    top.set_title("Fig. 8: throughput and MFU across scales (simulated)", fontsize=10)
    _bars(bottom, labels, {p: [r.mfu(p) for r in runs] for p in policies}, "MFU")
    bottom.legend(fontsize=7, ncol=len(policies), loc="upper center")
    return png_bytes(figure)


def fig9(report: Report) -> bytes:
    run = report.focus
    figure = _figure(11, 5)
    top, bottom = figure.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 2]})
    steps = range(1, len(report.trace) + 1)
    top.plot(steps, report.trace, color="gray", linewidth=0.7)
    top.set_ylabel("imbalance")
    top.set_title(f"Fig. 9: {run.label} on {run.gpus} GPUs (simulated)", fontsize=10)
    for policy in FIG9_POLICIES:
        bottom.plot(steps, [it.mfu for it in run.results[policy].iterations], label=policy, linewidth=0.8)
    bottom.set_xlabel("iteration")
    bottom.set_ylabel("MFU")
    bottom.set_ylim(bottom=0)
    bottom.legend(fontsize=8, ncol=len(FIG9_POLICIES), loc="lower right")
    return png_bytes(figure)


def fig10(report: Report) -> bytes:
    figure = _figure(11, 4)
    panels = figure.subplots(1, 2)
    for axes, runs, title in ((panels[0], report.sparsity, "(a) sparsity (top-k)"),
                              (panels[1], report.seq_length, "(b) sequence length")):
        policies = [p for p in runs[0].results if p != "oracle"]
        _bars(axes, [r.label for r in runs], {p: [r.mfu(p) for r in runs] for p in policies}, "MFU")
        axes.set_title(f"Fig. 10{title} (simulated)", fontsize=10)
    panels[1].legend(fontsize=7)
    return png_bytes(figure)


def fig11(report: Report) -> bytes:
    run = report.ablation
    figure = _figure(6, 4)
    axes = figure.subplots()
    values = [run.mfu(level) for level in ABLATION]
    axes.bar(ABLATION, values, color="tab:blue")
    for x, (a, b) in enumerate(zip(values, values[1:]), 1):
        axes.annotate(f"{b / a:.2f}x", (x, b), ha="center", va="bottom", fontsize=8)
    axes.set_ylabel("MFU")
    axes.set_title(f"Fig. 11: ablation, {report.config.focus} (simulated)", fontsize=10)
    return png_bytes(figure)


def figures(report: Report) -> dict[str, bytes]:
    """``{file name under docs/img: PNG bytes}``."""
    return {"repro-fig8.png": fig8(report), "repro-fig9.png": fig9(report), "repro-fig10.png": fig10(report),
            "repro-fig11.png": fig11(report)}
