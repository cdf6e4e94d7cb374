"""Turn a bench run's raw numbers into medians, ratios, a markdown table and a PNG plot.

Why separate from bench.py: this part is pure (no servers, no HTTP), so the statistics, the
ratios and the rendering are unit-tested from synthetic numbers; bench.py only measures.

Conventions: every timed quantity is a list of raw samples (one per repeat) summarised as
median with min-max; a ratio between two runs is the ratio of their medians from the same
bench invocation (never across invocations). A missing measurement is None and renders as
"n/a" with the reason the run recorded.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

GIB = 2**30

# (key in a row's "stats", column title, scale, digits); scale turns seconds into ms
TIMED_COLUMNS = (
    ("ttft_s", "TTFT ms", 1000.0, 1),
    ("prefill_tok_s", "prefill tok/s", 1.0, 0),
    ("decode_tok_s_1", "decode tok/s (1 stream)", 1.0, 1),
    ("decode_tok_s_batch", "decode tok/s (batch {batch})", 1.0, 1),
)
RATIO_METRICS = ("decode_tok_s_1", "decode_tok_s_batch", "ttft_s", "prefill_tok_s")


def summarize(values: Iterable[float | None]) -> dict | None:
    """Median, min, max and count of the non-None samples; None when there are none."""
    xs = sorted(float(v) for v in values if v is not None)
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


def ratio(numerator: Mapping | None, denominator: Mapping | None) -> float | None:
    """Ratio of two summaries' medians (same run); None if either is missing or the divisor is 0."""
    if not numerator or not denominator or not denominator.get("median"):
        return None
    return numerator["median"] / denominator["median"]


def pooled_hit_rate(requests: Sequence[Mapping]) -> dict | None:
    """Hit rate over all requests' routed selections (1 - missed / observed), plus per-request spread.

    Each request carries the server's totals: observed_selections, missed_selections,
    observed_mass, inactive_mass.
    """
    rows = [r for r in requests if r.get("observed_selections")]
    if not rows:
        return None
    observed = sum(r["observed_selections"] for r in rows)
    missed = sum(r["missed_selections"] for r in rows)
    mass = sum(r.get("observed_mass") or 0.0 for r in rows)
    inactive = sum(r.get("inactive_mass") or 0.0 for r in rows)
    per_request = [1.0 - r["missed_selections"] / r["observed_selections"] for r in rows]
    return {
        "hit_rate": 1.0 - missed / observed,
        "mass_hit_rate": 1.0 - inactive / mass if mass else None,
        "observed_selections": observed,
        "missed_selections": missed,
        "requests": len(rows),
        "per_request": summarize(per_request),
    }


def uva_offloaded_bytes(layer_expert_bytes: Sequence[int], max_bytes: int) -> int:
    """Bytes stock vLLM's UVA offloader moves to host memory with --cpu-offload-params w13_weight w2_weight.

    It walks the decoder layers in order and offloads whole parameters while its running total is
    below the limit (vllm/model_executor/offloader/uva.py): per MoE layer w13 (gate+up, 2/3 of the
    layer's expert bytes) then w2 (down, 1/3). So it is layer- (parameter-) granular and may
    overshoot the limit by up to one parameter.
    """
    offloaded = 0
    for layer_bytes in layer_expert_bytes:
        for part in (layer_bytes * 2 // 3, layer_bytes - layer_bytes * 2 // 3):
            if offloaded >= max_bytes:
                return offloaded
            offloaded += part
    return offloaded


# ----------------------------------------------------------------------------- summary


def run_stats(run: Mapping) -> dict:
    """Per run: summaries of every timed quantity, the hit rate, swaps and memory."""
    timing = run.get("timing") or {}
    single = timing.get("single") or []
    batch = timing.get("batch") or []
    stats: dict[str, Any] = {
        "ttft_s": summarize(s.get("ttft_s") for s in single),
        "prefill_tok_s": summarize(s.get("prefill_tok_s") for s in single),
        "decode_tok_s_1": summarize(s.get("decode_tok_s") for s in single),
        "decode_tok_s_batch": summarize(b.get("decode_tok_s") for b in batch),
        "batch_ttft_s": summarize(b.get("ttft_median_s") for b in batch),
        "open_s": summarize(s.get("open_s") for s in single),
    }
    swaps = run.get("swaps") or []
    real = [s for s in swaps if not s.get("noop") and s.get("kind") != "warm"]
    stats["swap_count"] = len(real)
    stats["open_count"] = len(swaps)
    stats["swap_latency_s"] = summarize(s.get("server_seconds") for s in real)
    stats["open_latency_s"] = summarize(s.get("server_seconds") for s in swaps)
    stats["bytes_copied_total"] = sum(int(s.get("bytes_copied") or 0) for s in swaps) if swaps else None
    stats["bytes_copied_per_swap"] = summarize(s.get("bytes_copied") for s in real)
    return stats


def greedy_matrix(runs: Sequence[Mapping], reference: str | None) -> dict:
    """Per run: which prompts' greedy outputs equal the reference run's (from run["greedy_vs_ref"])."""
    out = {}
    for run in runs:
        cmp = run.get("greedy_vs_ref")
        if cmp is not None:
            out[run["label"]] = cmp
    return {"reference": reference, "runs": out}


def ratio_matrix(runs: Sequence[Mapping], metric: str) -> dict[str, dict[str, float | None]]:
    """ratios[a][b] = median(a) / median(b) for one metric, over the runs that measured it."""
    have = [(r["label"], (r.get("stats") or {}).get(metric)) for r in runs]
    have = [(label, s) for label, s in have if s]
    return {a: {b: ratio(sa, sb) for b, sb in have if b != a} for a, sa in have}


def summarize_runs(runs: list[dict], reference: str | None) -> dict:
    """Fill each run's "stats" and return the cross-run part of the report."""
    for run in runs:
        run["stats"] = run_stats(run) if run.get("status") == "ok" else {}
    ok = [r for r in runs if r.get("status") == "ok"]
    ratios = {m: ratio_matrix(ok, m) for m in RATIO_METRICS}
    return {"reference": reference, "ratios": ratios, "greedy": greedy_matrix(ok, reference)}


# ----------------------------------------------------------------------------- markdown


def fmt_num(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "n/a"
    if abs(x) >= 1e5:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def fmt_summary(s: Mapping | None, scale: float = 1.0, digits: int = 1) -> str:
    """'median [min–max]' (just the value when there is one sample)."""
    if not s:
        return "n/a"
    med, lo, hi = s["median"] * scale, s["min"] * scale, s["max"] * scale
    if s.get("n", 1) == 1 or lo == hi:
        return fmt_num(med, digits)
    return f"{fmt_num(med, digits)} [{fmt_num(lo, digits)}–{fmt_num(hi, digits)}]"


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "n/a"
    n = float(n)
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def _hit_cell(run: Mapping) -> str:
    hit = run.get("hit_rate") or {}
    if hit.get("hit_rate") is None:
        return "n/a"
    text = f"{hit['hit_rate']:.3f}"
    spread = hit.get("per_request")
    if spread and spread.get("n", 1) > 1 and spread["min"] != spread["max"]:
        text += f" [{spread['min']:.3f}–{spread['max']:.3f}]"
    return text + (" (derived)" if hit.get("source", "").startswith("derived") else "")


def _mem_cell(run: Mapping) -> str:
    mem = run.get("gpu_memory") or {}
    if mem.get("peak_used_bytes") is None:
        return mem.get("note") or "n/a"
    text = fmt_bytes(mem["peak_used_bytes"])
    if mem.get("model_loading_gib") is not None:
        text += f" (weights {mem['model_loading_gib']:.2f} GiB)"
    return text


def _greedy_cell(run: Mapping, reference: str | None) -> str:
    if run["label"] == reference:
        return "reference"
    cmp = run.get("greedy_vs_ref")
    if not cmp:
        return "n/a"
    return f"{cmp['identical']}/{cmp['of']}"


def _budget_cell(run: Mapping) -> str:
    b = run.get("budget_bytes")
    if b is None:
        return run.get("budget_note") or "—"
    return f"{b / GIB:.4g}"


def markdown_table(report: Mapping) -> str:
    """The per-run table (one row per arm and budget), as GitHub markdown."""
    cfg = report.get("config") or {}
    batch = cfg.get("batch", "N")
    reference = (report.get("summary") or {}).get("reference")
    head = (
        ["arm", "budget GiB"]
        + [t.format(batch=batch) for _, t, _, _ in TIMED_COLUMNS]
        + ["router hit rate", "bytes copied by swaps", "swap latency ms", "peak GPU memory", "greedy = ref"]
    )
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in report.get("runs") or []:
        if run.get("status") != "ok":
            cells = [run["label"], _budget_cell(run)] + [f"{run.get('status')}"] + [""] * (len(head) - 3)
            lines.append("| " + " | ".join(cells) + " |")
            continue
        st = run.get("stats") or {}
        timed = [fmt_summary(st.get(k), scale, d) if st.get(k) else "n/a" for k, _, scale, d in TIMED_COLUMNS]
        swaps = (
            "n/a (no swaps)"
            if not run.get("reap")
            else (f"{fmt_bytes(st.get('bytes_copied_total'))} in {st.get('swap_count', 0)} swap(s)")
        )
        latency = (
            "n/a"
            if not run.get("reap")
            else (
                fmt_summary(st.get("swap_latency_s"), 1000.0, 2)
                if st.get("swap_latency_s")
                else f"no swaps (opens {fmt_summary(st.get('open_latency_s'), 1000.0, 2)})"
            )
        )
        cells = [
            run["label"],
            _budget_cell(run),
            *timed,
            _hit_cell(run),
            swaps,
            latency,
            _mem_cell(run),
            _greedy_cell(run, reference),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_report(report: Mapping) -> str:
    """Header (versions, hardware, model, command), the table, notes, ratios and per-prompt greedy."""
    env = report.get("environment") or {}
    model = report.get("model") or {}
    shape = model.get("shape") or {}
    plan = report.get("plan") or {}
    cfg = report.get("config") or {}
    summary = report.get("summary") or {}
    out = ["# reap-swap bench", ""]
    out.append(f"- command: `{report.get('command')}`")
    for source in report.get("merged_from") or []:
        out.append(
            f"  - merged from: `{source.get('command')}` ({source.get('started_at')} – {source.get('finished_at')})"
        )
    out.append(
        f"- vLLM {env.get('vllm_version')} ({env.get('vllm_distribution')}), platform "
        f"{env.get('platform')}, {env.get('device')}"
    )
    out.append(
        f"- model {model.get('path')}: {shape.get('architecture')}, {shape.get('num_layers')} layers "
        f"({len(shape.get('moe_layers') or [])} MoE), {shape.get('num_experts')} experts, top-{shape.get('top_k')}, "
        f"hidden {shape.get('hidden_size')}, moe_intermediate {shape.get('moe_intermediate_size')}, "
        f"{fmt_bytes(shape.get('expert_bytes'))} per expert, {fmt_bytes(model.get('total_expert_bytes'))} of experts"
    )
    out.append(
        f"- plan {plan.get('path')} (identity {str(plan.get('identity'))[:12]}): core "
        f"{fmt_bytes(plan.get('core_bytes'))}, budget {fmt_bytes(plan.get('budget_bytes'))}"
    )
    out.append(
        f"- {cfg.get('prompt_count')} prompts from {cfg.get('prompts')}; greedy outputs of "
        f"{cfg.get('max_tokens')} tokens; timing: {report.get('timing', {}).get('note')}"
    )
    out.append(
        f"- reap-swap {env.get('reap_swap_version')} (git {env.get('git_commit')}), "
        f"{report.get('started_at')} – {report.get('finished_at')}"
    )
    out += ["", markdown_table(report), ""]
    notes = []
    for run in report.get("runs") or []:
        if run.get("status") in ("skipped", "failed"):
            notes.append(f"- **{run['label']}** {run['status']}: {run.get('reason')}")
        notes += [f"- {run['label']}: {note}" for note in run.get("notes") or ()]
        hit = run.get("hit_rate") or {}
        if run.get("status") == "ok" and hit.get("source"):
            notes.append(f"- {run['label']} hit rate: {hit['source']}")
    if notes:
        out += ["Notes:", *notes, ""]
    ref = summary.get("reference")
    dec = (summary.get("ratios") or {}).get("decode_tok_s_1") or {}
    if dec:
        labels = [r["label"] for r in report.get("runs") or [] if r["label"] in dec]  # run order
        out += [
            "Single-stream decode tok/s ratios (row / column, medians of this run):",
            "",
            "| | " + " | ".join(labels) + " |",
            "|" + "---|" * (len(labels) + 1),
        ]
        for a in labels:
            out.append(
                f"| {a} | " + " | ".join("1" if a == b else fmt_num(dec[a].get(b), 2) for b in labels) + " |"
            )
        out.append("")
    greedy = (summary.get("greedy") or {}).get("runs") or {}
    prompts = report.get("prompts") or []
    if greedy and ref:
        labels = list(greedy)
        out += [
            f"Greedy outputs vs {ref} per prompt (= identical, ≠@k first differing token):",
            "",
            "| prompt | " + " | ".join(labels) + " |",
            "|" + "---|" * (len(labels) + 1),
        ]
        for i, p in enumerate(prompts):
            cells = []
            for label in labels:
                cmp = greedy[label]
                same = cmp["per_prompt"][i] if i < len(cmp["per_prompt"]) else None
                cells.append(
                    "=" if same else f"≠@{cmp['first_divergence'][i]}" if same is not None else "n/a"
                )
            out.append(f"| {i}: {p.get('preview', '')} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------- plot


def _series(runs: Sequence[Mapping], arm: str) -> list[Mapping]:
    return sorted(
        (r for r in runs if r.get("arm") == arm and r.get("status") == "ok"),
        key=lambda r: r.get("budget_bytes") or 0,
    )


def plot(report: Mapping, path: str | Path) -> Path:
    """PNG: decode tok/s and router hit rate per arm; a curve over budgets when there are several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in report.get("runs") or [] if r.get("status") == "ok"]
    batch = (report.get("config") or {}).get("batch", "N")
    budgets = sorted({r["budget_bytes"] for r in runs if r.get("budget_dependent") and r.get("budget_bytes")})
    timing_note = (report.get("timing") or {}).get("note", "")
    fig, (ax_dec, ax_hit) = plt.subplots(1, 2, figsize=(12, 4.6))
    if len(budgets) > 1:
        unit, size = ("GiB", GIB) if budgets[-1] >= GIB else ("MiB", 2**20)
        colors = {arm: f"C{i}" for i, arm in enumerate(dict.fromkeys(r["arm"] for r in runs))}
        for arm, color in colors.items():
            series = _series(runs, arm)
            if series and series[0].get("budget_dependent"):
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
                            xs,
                            med,
                            yerr=err,
                            fmt=style,
                            color=color,
                            capsize=3,
                            label=f"{arm} ({'1 stream' if key.endswith('_1') else f'batch {batch}'})",
                        )
                hs = [(r.get("hit_rate") or {}).get("hit_rate") for r in series]
                derived = (series[0].get("hit_rate") or {}).get("source", "").startswith("derived")
                ax_hit.plot(
                    xs,
                    [h if h is not None else float("nan") for h in hs],
                    "-o",
                    color=color,
                    label=arm + (" (derived)" if derived else ""),
                )
            else:  # budget-independent arms: one level across the plot
                for r in series:
                    for key, style in (("decode_tok_s_1", ":"), ("decode_tok_s_batch", "-.")):
                        d = ((r.get("stats") or {}).get(key) or {}).get("median")
                        if d is not None:
                            ax_dec.axhline(
                                d,
                                linestyle=style,
                                color=color,
                                label=f"{arm} ({'1 stream' if key.endswith('_1') else f'batch {batch}'})",
                            )
                    h = (r.get("hit_rate") or {}).get("hit_rate")
                    if h is not None:
                        derived = (r.get("hit_rate") or {}).get("source", "").startswith("derived")
                        ax_hit.axhline(
                            h, linestyle=":", color=color, label=arm + (" (derived)" if derived else "")
                        )
        for ax in (ax_dec, ax_hit):
            ax.set_xlabel(f"expert budget ({unit} of GPU memory)")
            ax.set_xticks([b / size for b in budgets], [f"{b / size:.3g}" for b in budgets])
    else:
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
            color=[
                "tab:gray"
                if (r.get("hit_rate") or {}).get("source", "").startswith("derived")
                else "tab:blue"
                for r in runs
            ],
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
        "router hit rate" + ("" if len(budgets) > 1 else " (grey: derived, blue: server counters)")
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
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _wrap(text: str, width: int = 48) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width)) or ""
