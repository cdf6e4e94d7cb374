"""The pure parts of research/gpu/gpu_quant_e2e.py (no server, no GPU): the case list, the swap
points, which cases a --stock-twice / --eager-pair value selects, and the summary of the cases'
JSON into rows, verdicts and the markdown table. gpu_quant_e2e.py re-exports these names.
"""

from __future__ import annotations

import json
from pathlib import Path

from families_report import bound_rows

from reap_swap.bench.server_driver import compare
from reap_swap.engine.moe_probe import compare_probes

# case -> (checkpoint format, extra vLLM arguments)
CASES = {
    "bf16": ("bf16", []),
    "fp8-block": ("fp8-block", []),
    "fp8-tensor": ("fp8-tensor", []),
    "ct-fp8": ("ct-fp8", []),
    "fp8-online": ("bf16", ["--quantization", "fp8"]),
    "awq": ("awq", []),
    "gptq": ("gptq", []),
    "ct-w4a16": ("ct-w4a16", []),
    "mxfp4": ("mxfp4", []),
}
TINY = ["--hidden", "256", "--moe-intermediate", "128", "--experts", "8", "--top-k", "2", "--heads", "4"]
TINY += ["--kv-heads", "2", "--head-dim", "64", "--vocab", "512"]
GPT_OSS_SHAPE = ["--hidden", "2880", "--moe-intermediate", "2880", "--experts", "128", "--top-k", "4"]
GPT_OSS_SHAPE += ["--heads", "64", "--kv-heads", "8", "--head-dim", "64"]
KV_BYTES = 512 * 2**20


STOCK_TWICE_WORDS = ("refused", "all", "none")


def listed(spec: str, name: str, binds: bool) -> bool:
    """Is case `name` selected by a --stock-twice / --eager-pair value (cases and words)?"""
    items = set(spec.split(","))
    return name in items or "all" in items or ("refused" in items and not binds)


def checkpoint_ready(folder: Path, fmt: str, layers: int) -> bool:
    """A complete checkpoint of this format and depth (its recipe is the writer's last file)."""
    try:
        recipe = json.loads((folder / "reap_quant_recipe.json").read_text())
    except (OSError, ValueError):
        return False
    return recipe.get("format") == fmt and recipe.get("layers") == layers


SWAPS = (("25", 25, 0), ("50", 50, 0), ("100", 100, 0), ("0-after", 0, 0), ("50-other", 50, 50))


# ----------------------------------------------------------------------------- summary


def _rank0(probe: dict | None) -> dict | None:
    ranks = (probe or {}).get("ranks") or []
    return ranks[0] if ranks and not ranks[0].get("error") else None


def _probe_size(digest_name: str) -> str:
    """'model.layers.6.mlp.experts@64' -> '64' (compare_probes' names: layer@probe size)."""
    return digest_name.rsplit("@", 1)[1]


def _phase_checks(stock: dict, phases: dict) -> tuple[list[str], list[str], set[str] | None]:
    """Phases whose greedy text / MoE digests differ from stock's (or could not be compared), and the probe
    sizes at which digests differ (None when some phase's probe could not be compared)."""
    bad_text, bad_probe, sizes = [], [], set()
    ref_p = _rank0(stock.get("moe_probe"))
    for label, ph in phases.items():
        c = compare(stock["greedy"], ph.get("greedy") or [])
        if c["identical"] != c["of"] or c["of"] != len(stock["greedy"]):
            bad_text.append(label)
        got = _rank0(ph.get("moe_probe"))
        cp = compare_probes(ref_p, got) if ref_p and got else {"comparable": False}
        if not cp.get("comparable") or cp["equal"] != cp["of"]:
            bad_probe.append(label)
        if not cp.get("comparable"):
            sizes = None
        elif sizes is not None:
            sizes |= {_probe_size(d) for d in cp["differ"]}
    return bad_text, bad_probe, sizes


def _swap_stats(phases: dict) -> dict:
    swaps = [ph["swap"] for ph in phases.values() if ph.get("swap")]
    moved = [s for s in swaps if s.get("bytes_copied")]
    return {
        "bytes_mismatch": [
            s.get("expected_bytes") for s in swaps if (s.get("bytes_copied") or 0) != s.get("expected_bytes")
        ],
        "swap_errors": [s.get("error") for s in swaps if s.get("status") != 200],
        "gbps_client": [round(s["bytes_copied"] / (s["client_ms"] / 1000) / 1e9, 2) for s in moved],
        "gbps_workers": [round(s["gbps_workers"], 2) for s in moved if s.get("gbps_workers")],
    }


def engine_facts(status: dict) -> dict:
    """Rank 0's engine facts from /reap/status (`workers[i].engine`, swap_report.engine_summary):
    the mapping unit, pool slots, kept-whole HBM, re-homed layers and per-layer refusals."""
    workers = (status or {}).get("workers") or [{}]
    return workers[0].get("engine") or {}


def _stock_repeat(stock: dict, stock2: dict) -> dict | None:
    """Stock served twice (separate processes): identical tokens, logprobs and MoE digests?"""
    if not stock2.get("greedy") or not stock.get("greedy"):
        return None
    c = compare(stock["greedy"], stock2["greedy"])
    logprobs = [a.get("logprobs") == b.get("logprobs") for a, b in zip(stock["greedy"], stock2["greedy"])]
    p1, p2 = _rank0(stock.get("moe_probe")), _rank0(stock2.get("moe_probe"))
    cp = compare_probes(p1, p2) if p1 and p2 else {"comparable": False}
    probe_same = bool(cp.get("comparable")) and cp["equal"] == cp["of"]
    same = c["identical"] == c["of"] and all(logprobs) and probe_same
    return {
        "tokens": c,
        "logprobs_identical": sum(logprobs),
        "probe_equal": probe_same,
        "deterministic": same,
    }


def _reap_repeat(phases: dict) -> dict | None:
    """The reap-swap server probed twice with the same resident set (nothing: phases 0 and 0-after), in one
    process: which (layer, tokens) digests differ? Any difference is the kernel's own run-to-run variation
    (run 18: INT4 Marlin at 64 tokens), not residency; `tokens` lists the probe sizes where it showed."""
    a, b = (
        _rank0((phases.get("0") or {}).get("moe_probe")),
        _rank0((phases.get("0-after") or {}).get("moe_probe")),
    )
    cp = compare_probes(a, b) if a and b else {"comparable": False}
    if not cp.get("comparable"):
        return None
    return {"differ": cp["differ"], "tokens": sorted({_probe_size(d) for d in cp["differ"]}, key=int)}


def _eager_pair(res: dict) -> dict | None:
    """stock --enforce-eager vs reap-swap --enforce-eager at every residency point: identical
    tokens and logprobs? (No torch.compile: Inductor's per-process choices cannot differ.)"""
    stock, reap = res.get("stock_eager"), res.get("reap_eager")
    if stock is None and reap is None:
        return None
    errors = {
        k: v["error"][:300]
        for k, v in (("stock_eager", stock or {}), ("reap_eager", reap or {}))
        if v.get("error")
    }
    if errors or not (stock or {}).get("greedy") or not (reap or {}).get("phases"):
        return {"comparable": False, "errors": errors}
    differs, logprobs_differ = [], []
    for label, ph in reap["phases"].items():
        got = ph.get("greedy") or []
        c = compare(stock["greedy"], got)
        if c["identical"] != c["of"] or c["of"] != len(stock["greedy"]):
            differs.append(label)
        if [g.get("logprobs") for g in stock["greedy"]] != [g.get("logprobs") for g in got]:
            logprobs_differ.append(label)
    return {"comparable": True, "text_differs": differs, "logprobs_differ": logprobs_differ,
            "identical": not differs and not logprobs_differ}  # fmt: skip


def case_row(res: dict) -> dict:
    stock, reap, stock2 = res.get("stock") or {}, res.get("reap") or {}, res.get("stock2") or {}
    row = {"case": res.get("case"), "binds": res.get("binds"), "timed_out": res.get("timed_out", False)}
    arms = (("stock", stock), ("reap", reap), ("stock2", stock2))
    row["errors"] = {k: v["error"][:300] for k, v in arms if v.get("error")}
    eng = engine_facts(reap.get("status_end") or reap.get("status_start") or {})
    unit, kept = eng.get("unit_bytes"), eng.get("kept_whole_hbm_bytes")
    layers = len(eng.get("layers_rehomed") or []) or 1
    row.update(
        unit_mib=unit / 2**20 if unit else None,
        payload_mib=(res.get("payload_bytes") or 0) / 2**20,
        kept_whole_bytes=kept,
        pool_slots=eng.get("pool_slots"),
        layers_rehomed=eng.get("layers_rehomed"),
        refused_layers=eng.get("refused_layers") or {},
        engine_reason=eng.get("reason"),
        kept_per_layer=kept / layers if kept is not None else None,
    )
    row["refusal"] = _refusal_note(row) or res.get("engine_refusal")
    row["stock_repeat"] = _stock_repeat(stock, stock2)
    row["eager_pair"] = _eager_pair(res)
    if stock.get("greedy") and reap.get("phases"):
        row["text_differs"], row["probe_differs"], sizes = _phase_checks(stock, reap["phases"])
        row["reap_repeat"] = _reap_repeat(reap["phases"])
        nondet = set((row["reap_repeat"] or {}).get("tokens") or [])
        row["probe_diffs_kernel_nondet"] = bool(nondet) and sizes is not None and sizes <= nondet
        row.update(_swap_stats(reap["phases"]))
        if any(p.get("decode_1") for p in reap["phases"].values()):  # --decode-tokens
            row["bound"] = bound_rows(reap["phases"], stock)
    row["verdict"] = _verdict(row)
    row["pass"] = row["verdict"] == "PASS"
    return row


def _refusal_note(row: dict) -> str | None:
    """Per-layer refusals, deduplicated: 'layers 0,1: <reason>'."""
    by_reason: dict[str, list[str]] = {}
    for name, why in row["refused_layers"].items():
        by_reason.setdefault(why, []).append(name.split(".")[2] if name.count(".") >= 2 else name)
    return "; ".join(f"layers {','.join(ls)}: {why}" for why, ls in by_reason.items()) or None


def _verdict(row: dict) -> str:
    """PASS / FAIL, STOCK-NONDET where stock served twice already differs from itself, or KERNEL-NONDET where
    everything passes but MoE digests that differ only at probe sizes where one reap process varies by itself."""
    if row["errors"] or row["timed_out"] or "text_differs" not in row:
        return "FAIL"

    text_and_swaps = not row["text_differs"] and not row["swap_errors"]
    same = text_and_swaps and not row["probe_differs"]

    def passes(digests_equal: bool) -> bool:
        if not (text_and_swaps and digests_equal):
            return False
        if row["binds"]:
            return not row["bytes_mismatch"] and bool(row["unit_mib"]) and not row["refused_layers"]
        # refused formats: up on the stock path, every layer's refusal recorded, no layer re-homed
        return bool(row["refused_layers"]) and not row["layers_rehomed"]

    if passes(same):
        return "PASS"
    repeat = row.get("stock_repeat")
    if not same and repeat is not None and not repeat["deterministic"]:
        return "STOCK-NONDET"  # reap cannot be held to bitwise equality with a stock that varies
    if row.get("probe_diffs_kernel_nondet") and passes(True):
        return "KERNEL-NONDET"  # digests differ only at probe sizes where one reap process varies by itself
    return "FAIL"


def markdown(doc: dict) -> str:
    head = (
        "| case | engine | pass | greedy differs at | MoE digests differ at | swap GB/s (client; workers) | "
        "bytes moved = admitted x payload | unit MiB (payload MiB) | pool slots | kept whole B/layer | refusal / error |"
    )
    lines = [f"quant e2e, {doc.get('wall_s', 0):.0f} s wall", "", head, "|" + "---|" * 11]
    for r in doc.get("rows") or [case_row(c) for c in doc["cases"].values()]:
        note = "; ".join(f"{k}: {v}" for k, v in r["errors"].items()) or str(r.get("refusal") or "")
        rep = r.get("stock_repeat")
        if rep is not None:
            det = "deterministic" if rep["deterministic"] else f"NOT deterministic {rep}"
            note = f"stock x2: {det}; {note}"
        same_set = r.get("reap_repeat")
        if same_set and same_set["differ"]:
            note = f"reap 0 vs 0-after (same set, one process) differ at {same_set['differ']}; {note}"
        eager = r.get("eager_pair")
        if eager is not None:
            what = (
                ("identical" if eager["identical"] else f"differ {eager}") if eager["comparable"] else eager
            )
            note = f"eager reap vs stock: {what}; {note}"
        note = ("TIMED OUT; " if r["timed_out"] else "") + note.replace("|", "/")[:400]
        gb = f"{r.get('gbps_client')}; {r.get('gbps_workers')}" if r.get("gbps_client") else "-"
        unit = (
            f"{r['unit_mib']:.1f} ({r['payload_mib']:.2f})"
            if r.get("unit_mib")
            else f"- ({r['payload_mib']:.2f})"
        )
        mism = r.get("bytes_mismatch")
        lines.append(
            f"| {r['case']} | {'bound' if r['binds'] else 'refused'} | {r.get('verdict') or 'FAIL'} | "
            f"{r.get('text_differs', '-')} | {r.get('probe_differs', '-')} | {gb} | "
            f"{'yes' if mism == [] else mism if mism else '-'} | {unit} | {r.get('pool_slots')} | "
            f"{r.get('kept_per_layer')} | {note} |"
        )
    return "\n".join(lines + _bound_lines(doc)) + "\n"


def _bound_lines(doc: dict) -> list[str]:
    """With --decode-tokens: each case's decode tok/s per phase against its bound (1 stream)."""
    rows = [r for r in doc.get("rows") or [case_row(c) for c in doc["cases"].values()] if r.get("bound")]
    if not rows:
        return []
    out = ["", "decode (1 stream) against t_resident + (1 - h) t_all_missed:", ""]
    out += [
        "| case | t_resident ms (from) | t_all_missed ms | phase: h / tok/s / ratio to bound |",
        "|---|---|---|---|",
    ]
    for r in rows:
        b = r["bound"]
        cells = "; ".join(
            f"{k}: {v['h']:.3f} / {v['tok_s']:.1f} / {v['ratio']:.3f}" + (" (fit)" if v["fit"] else "")
            if None not in (v.get("h"), v.get("tok_s"), v.get("ratio"))
            else f"{k}: -"
            for k, v in b["rows"].items()
        )
        tr, tm = b.get("t_resident_ms"), b.get("t_all_missed_ms")
        out.append(
            f"| {r['case']} | {tr and round(tr, 3)} ({b.get('t_resident_from')}) | {tm and round(tm, 3)} | {cells} |"
        )
    return out
