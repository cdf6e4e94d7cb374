"""A bench report as a PNG: decode tok/s and router hit rate per arm; a curve over budgets when a
bench ran several. Pure rendering (matplotlib, Agg) of what bench_report summarised."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from reap_swap.bench.report import GIB


def plot(report: Mapping, path: str | Path) -> Path:
    """PNG: decode tok/s and router hit rate per arm; a curve over budgets when there are several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report.get("runs") or [] if r.get("status") == "ok"]
    batch = (report.get("config") or {}).get("batch", "N")
    budgets = sorted({r["budget_bytes"] for r in runs if r.get("budget_dependent") and r.get("budget_bytes")})
    fig, (ax_dec, ax_hit) = plt.subplots(1, 2, figsize=(12, 4.6))
    if len(budgets) > 1:
        _budget_curves(ax_dec, ax_hit, runs, budgets, batch)
    else:
        _bars(ax_dec, ax_hit, runs, batch)
    _decorate(fig, ax_dec, ax_hit, report, runs, several_budgets=len(budgets) > 1)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _series(runs: Sequence[Mapping], arm: str) -> list[Mapping]:
    return sorted(
        (r for r in runs if r.get("arm") == arm and r.get("status") == "ok"),
        key=lambda r: r.get("budget_bytes") or 0,
    )


def _stream_label(arm: str, key: str, batch) -> str:
    return f"{arm} ({'1 stream' if key.endswith('_1') else f'batch {batch}'})"


def _derived(run: Mapping) -> bool:
    return (run.get("hit_rate") or {}).get("source", "").startswith("derived")


def _budget_curves(ax_dec, ax_hit, runs: Sequence[Mapping], budgets: Sequence[int], batch) -> None:
    """Budget-dependent arms as curves over the budgets, the others as one level across the plot."""
    unit, size = ("GiB", GIB) if budgets[-1] >= GIB else ("MiB", 2**20)
    colors = {arm: f"C{i}" for i, arm in enumerate(dict.fromkeys(r["arm"] for r in runs))}
    for arm, color in colors.items():
        series = _series(runs, arm)
        if series and series[0].get("budget_dependent"):
            _curve(ax_dec, ax_hit, arm, color, series, size, batch)
        else:
            _levels(ax_dec, ax_hit, arm, color, series, batch)
    for ax in (ax_dec, ax_hit):
        ax.set_xlabel(f"expert budget ({unit} of GPU memory)")
        ax.set_xticks([b / size for b in budgets], [f"{b / size:.3g}" for b in budgets])


def _curve(ax_dec, ax_hit, arm: str, color: str, series: Sequence[Mapping], size: int, batch) -> None:
    xs = [r["budget_bytes"] / size for r in series]
    for key, style in (("decode_tok_s_1", "-o"), ("decode_tok_s_batch", "--s")):
        sums = [(r.get("stats") or {}).get(key) for r in series]
        if any(sums):
            med = [st["median"] if st else float("nan") for st in sums]
            err = [
                [st["median"] - st["min"] if st else 0.0 for st in sums],
                [st["max"] - st["median"] if st else 0.0 for st in sums],
            ]
            ax_dec.errorbar(
                xs, med, yerr=err, fmt=style, color=color, capsize=3, label=_stream_label(arm, key, batch)
            )
    hs = [(r.get("hit_rate") or {}).get("hit_rate") for r in series]
    ax_hit.plot(
        xs,
        [h if h is not None else float("nan") for h in hs],
        "-o",
        color=color,
        label=arm + (" (derived)" if _derived(series[0]) else ""),
    )


def _levels(ax_dec, ax_hit, arm: str, color: str, series: Sequence[Mapping], batch) -> None:
    for r in series:
        for key, style in (("decode_tok_s_1", ":"), ("decode_tok_s_batch", "-.")):
            d = ((r.get("stats") or {}).get(key) or {}).get("median")
            if d is not None:
                ax_dec.axhline(d, linestyle=style, color=color, label=_stream_label(arm, key, batch))
        h = (r.get("hit_rate") or {}).get("hit_rate")
        if h is not None:
            ax_hit.axhline(h, linestyle=":", color=color, label=arm + (" (derived)" if _derived(r) else ""))


def _bars(ax_dec, ax_hit, runs: Sequence[Mapping], batch) -> None:
    """One budget: bars per run (decode tok/s per stream count, hit rate grey when derived)."""
    labels = [r["label"] for r in runs]
    x = list(range(len(labels)))
    width = 0.38
    for offset, key, name in (
        (-width / 2, "decode_tok_s_1", "1 stream"),
        (width / 2, "decode_tok_s_batch", f"batch {batch}"),
    ):
        meds, lo, hi = [], [], []
        for r in runs:
            s = (r.get("stats") or {}).get(key)
            meds.append(s["median"] if s else 0.0)
            lo.append(s["median"] - s["min"] if s else 0.0)
            hi.append(s["max"] - s["median"] if s else 0.0)
        if any(meds):
            ax_dec.bar([i + offset for i in x], meds, width, yerr=[lo, hi], capsize=3, label=name)
    ax_dec.set_xticks(x, labels, rotation=20, ha="right")
    hits = [(r.get("hit_rate") or {}).get("hit_rate") for r in runs]
    bars = ax_hit.bar(
        x,
        [h if h is not None else 0.0 for h in hits],
        color=["tab:gray" if _derived(r) else "tab:blue" for r in runs],
    )
    for bar, h in zip(bars, hits):
        ax_hit.annotate(
            "n/a" if h is None else f"{h:.3f}",
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax_hit.set_xticks(x, labels, rotation=20, ha="right")


def _decorate(fig, ax_dec, ax_hit, report: Mapping, runs: Sequence[Mapping], several_budgets: bool) -> None:
    """Titles, labels, legends, the why-not-measured note and the figure title."""
    timing_note = (report.get("timing") or {}).get("note", "")
    if not any(
        (r.get("stats") or {}).get("decode_tok_s_1") or (r.get("stats") or {}).get("decode_tok_s_batch")
        for r in runs
    ):
        ax_dec.text(
            0.5,
            0.5,
            _wrap(timing_note or "decode tok/s not measured"),
            ha="center",
            va="center",
            transform=ax_dec.transAxes,
            fontsize=9,
        )
    ax_dec.set_title("decode tok/s (median, min–max)")
    ax_dec.set_ylabel("tokens / s")
    ax_hit.set_title(
        "router hit rate" + ("" if several_budgets else " (grey: derived, blue: server counters)")
    )
    ax_hit.set_ylabel("hit rate")
    ax_hit.set_ylim(0, 1.05)
    for ax in (ax_dec, ax_hit):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    shape = (report.get("model") or {}).get("shape") or {}
    model_path = Path(str((report.get("model") or {}).get("path")))
    fig.suptitle(
        f"reap-swap bench: {'/'.join(model_path.parts[-2:])} "
        f"({shape.get('num_experts')} experts x {len(shape.get('moe_layers') or [])} layers) on "
        f"{(report.get('environment') or {}).get('device')}",
        fontsize=10,
    )


def _wrap(text: str, width: int = 48) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) or ""
