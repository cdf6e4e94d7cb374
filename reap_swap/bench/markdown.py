"""A bench report as markdown: the header (versions, hardware, model, command), the table, notes,
decode ratios and per-prompt greedy agreement. Pure: renders what bench_report summarised."""

from __future__ import annotations

from collections.abc import Mapping

from reap_swap.bench.report import GIB, TIMED_COLUMNS


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
    out = ["# reap-swap bench", "", *_header(report), "", markdown_table(report), ""]
    notes = _notes(report)
    if notes:
        out += ["Notes:", *notes, ""]
    out += _decode_ratios(report)
    out += _greedy_table(report)
    return "\n".join(out)


def _header(report: Mapping) -> list[str]:
    env = report.get("environment") or {}
    model = report.get("model") or {}
    shape = model.get("shape") or {}
    plan = report.get("plan") or {}
    cfg = report.get("config") or {}
    out = [f"- command: `{report.get('command')}`"]
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
    return out


def _notes(report: Mapping) -> list[str]:
    notes = []
    for run in report.get("runs") or []:
        if run.get("status") in ("skipped", "failed"):
            notes.append(f"- **{run['label']}** {run['status']}: {run.get('reason')}")
        notes += [f"- {run['label']}: {note}" for note in run.get("notes") or ()]
        hit = run.get("hit_rate") or {}
        if run.get("status") == "ok" and hit.get("source"):
            notes.append(f"- {run['label']} hit rate: {hit['source']}")
    return notes


def _decode_ratios(report: Mapping) -> list[str]:
    dec = ((report.get("summary") or {}).get("ratios") or {}).get("decode_tok_s_1") or {}
    if not dec:
        return []
    labels = [r["label"] for r in report.get("runs") or [] if r["label"] in dec]  # run order
    out = [
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
    return out


def _greedy_table(report: Mapping) -> list[str]:
    summary = report.get("summary") or {}
    ref = summary.get("reference")
    greedy = (summary.get("greedy") or {}).get("runs") or {}
    if not (greedy and ref):
        return []
    labels = list(greedy)
    out = [
        f"Greedy outputs vs {ref} per prompt (= identical, ≠@k first differing token):",
        "",
        "| prompt | " + " | ".join(labels) + " |",
        "|" + "---|" * (len(labels) + 1),
    ]
    for i, p in enumerate(report.get("prompts") or []):
        cells = []
        for label in labels:
            cmp = greedy[label]
            same = cmp["per_prompt"][i] if i < len(cmp["per_prompt"]) else None
            cells.append("=" if same else f"≠@{cmp['first_divergence'][i]}" if same is not None else "n/a")
        out.append(f"| {i}: {p.get('preview', '')} | " + " | ".join(cells) + " |")
    out.append("")
    return out
