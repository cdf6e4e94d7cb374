#!/usr/bin/env python3
"""Tables for research.md from one device session's results (research/gpu/gpu_session.sh -> /tmp/sess).

usage: python research/gpu/gpu_summarize.py SESSION_DIR [--json derived.json]
       python research/gpu/gpu_summarize.py --families DIR   (research/gpu/gpu_families.sh's results)

Reads SESSION_DIR/{e2e0,e2e1,tp}/gpu_e2e.json, the skewed model's observation file and the
bench folders; prints markdown: greedy identity, decode tok/s against the bound
t_token = t_resident + (1 - h) * t_all_missed, swap speed, the counter check, TP=2, and the
skewed model's routing statistics. Nothing here measures anything; it only derives.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from reap_swap.bench.server_driver import compare  # noqa: E402


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def med(s: dict | None, key="median") -> float | None:
    return None if not s else s.get(key)


def fmt(x, d=1) -> str:
    return "n/a" if x is None else f"{x:.{d}f}"


def span(s: dict | None, d=1) -> str:
    if not s:
        return "n/a"
    return f"{s['median']:.{d}f} ({s['min']:.{d}f}–{s['max']:.{d}f})"


def divergence_detail(ref: list[dict], got: list[dict]) -> list:
    """Per diverging prompt: position, both tokens and their logprobs there (near-tie evidence)."""
    out = []
    for i, (a, b) in enumerate(zip(ref, got)):
        d = next((j for j, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
        if d is not None:
            out.append(
                {
                    "prompt": i,
                    "at": d,
                    "ref": [a["tokens"][d], a["logprobs"][d]],
                    "got": [b["tokens"][d], b["logprobs"][d]],
                }
            )
    return out


def greedy_section(ref_name: str, ref: list[dict] | None, entries: list[tuple[str, list[dict]]]) -> list[str]:
    lines = [
        f"Reference: {ref_name}.",
        "",
        "| run | identical | first divergence per prompt |",
        "|---|---|---|",
    ]
    details = {}
    for name, got in entries:
        if not ref or not got:
            lines.append(f"| {name} | n/a | |")
            continue
        c = compare(ref, got)
        lines.append(f"| {name} | {c['identical']}/{c['of']} | {c['first_divergence']} |")
        det = divergence_detail(ref, got)
        if det:
            details[name] = det
    for name, det in details.items():
        lines.append("")
        lines.append(
            f"{name}: at the first divergence (token, its logprob) ref vs this run: "
            + "; ".join(f"prompt {d['prompt']} @ {d['at']}: {d['ref']} vs {d['got']}" for d in det)
        )
    return lines


def sweep_section(sweep: dict, stock: dict) -> tuple[list[str], dict]:
    phases = sweep.get("phases", {})
    rows, derived = [], {}
    d = {k: phases.get(k, {}) for k in ("0", "25", "50", "100")}
    lines = [
        "| resident | hit rate h | 1 stream tok/s | bound | ratio | 8 streams tok/s | bound | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for metric in ("decode_1", "decode_8"):
        t100, t0 = med(d["100"].get(metric)), med(d["0"].get(metric))
        derived[metric] = {
            "t_resident_ms": 1000 / t100 if t100 else None,
            "t_all_missed_ms": (1000 / t0 - 1000 / t100) if t0 and t100 else None,
        }
    for k in ("100", "50", "25", "0"):
        p = d[k]
        miss = ((p.get("router_misses") or {}).get("totals") or {}).get("miss_ratio")
        h = None if miss is None else 1 - miss
        cells = [f"{k} %", fmt(h, 3)]
        for metric in ("decode_1", "decode_8"):
            got = med(p.get(metric))
            tr, tm = derived[metric]["t_resident_ms"], derived[metric]["t_all_missed_ms"]
            bound = 1000 / (tr + (1 - h) * tm) if None not in (h, tr, tm) else None
            cells += [span(p.get(metric)), fmt(bound), fmt(got / bound if got and bound else None, 3)]
            derived.setdefault("rows", {}).setdefault(k, {})[metric] = {"h": h, "tok_s": got, "bound": bound}
        rows.append("| " + " | ".join(cells) + " |")
    lines += rows
    s1, s100 = med(stock.get("decode_1")), med(d["100"].get("decode_1"))
    s8, s100b = med(stock.get("decode_8")), med(d["100"].get("decode_8"))
    lines += [
        "",
        f"stock vLLM, every expert in HBM: 1 stream {span(stock.get('decode_1'))}, 8 streams "
        f"{span(stock.get('decode_8'))}; reap-swap at 100 % / stock: "
        f"{fmt(s100 / s1 if s1 and s100 else None, 3)} (1 stream), "
        f"{fmt(s100b / s8 if s8 and s100b else None, 3)} (8 streams).",
    ]
    lines.append(
        f"t_resident = {fmt(derived['decode_1']['t_resident_ms'], 3)} ms, t_all_missed = "
        f"{fmt(derived['decode_1']['t_all_missed_ms'], 3)} ms per token (1 stream)."
    )
    return lines, derived


def swap_section(sweep: dict) -> list[str]:
    lines = [
        "| swap-in | experts | bytes | server total ms | worker ms | GB/s (worker) | evict back ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, entry in (sweep.get("swaps") or {}).items():
        runs = entry["runs"]
        ins = [r["in"] for r in runs if r["in"]["status"] == 200]
        if not ins:
            lines.append(f"| {label} | {entry['experts']} | failed | | | | |")
            continue
        total = [r["timing"]["total_seconds"] * 1000 for r in ins]
        work = [r["timing"]["phases"]["workers"] * 1000 for r in ins]
        gbps = [r.get("gbps_workers") or 0 for r in ins]
        outs = [r["out"]["timing"]["total_seconds"] * 1000 for r in runs if r["out"]["status"] == 200]

        def m(v):
            return f"{statistics.median(v):.1f} ({min(v):.1f}–{max(v):.1f})" if v else "n/a"

        lines.append(
            f"| {label} | {entry['experts']} | {ins[0].get('bytes_copied'):,} | {m(total)} | {m(work)} | "
            f"{m(gbps)} | {m(outs)} |"
        )
        noops = [r["noop"] for r in runs if r.get("noop")]
        if noops:
            lines.append(
                f"| no-op (same set again) | 0 | {noops[0].get('bytes_copied')} | "
                f"{m([n['timing']['total_seconds'] * 1000 for n in noops])} | | client round trip "
                f"{m([n['client_ms'] for n in noops])} ms | |"
            )
    return lines


def counter_section(check: dict | None) -> list[str]:
    if not check:
        return ["(not run)"]
    lines = [
        f"all requests equal: **{check.get('all_equal')}**",
        "",
        "| request | routed_experts shape | ours (observed, missed) | theirs (observed, missed) | equal |",
        "|---|---|---|---|---|",
    ]
    for r in check["requests"]:
        ours = (
            sum(sum(p["ours_counts"] or []) for p in r["layers"]),
            sum(p["ours_missed"] or 0 for p in r["layers"]),
        )
        theirs = (
            sum(sum(p["theirs_counts"]) for p in r["layers"]),
            sum(p["theirs_missed"] for p in r["layers"]),
        )
        lines.append(f"| {r['request']} | {r['routed_experts_shape']} | {ours} | {theirs} | {r['equal']} |")
    return lines


def skew_section(sess: Path) -> list[str]:
    obs = sess / "skew.obs.pt"
    if not obs.exists():
        return ["(no observation file)"]
    import numpy as np
    import torch

    data = torch.load(obs, weights_only=False)
    meta = data.get("__reap_swap__", {})
    lines = [
        "| layer | top 25 % share | top 50 % share | per-tag top 25 % (own top) | tags' top-25 % overlap (Jaccard, mean) |",
        "|---|---|---|---|---|",
    ]
    tags = meta.get("tags") or {}
    for layer in sorted(k for k in data if isinstance(k, int)):
        f = np.asarray(data[layer]["expert_frequency"], dtype=np.float64)
        s = np.sort(f)[::-1]
        q = len(s) // 4
        per_tag, tops = [], []
        for t, layers in tags.items():
            ft = np.asarray(layers[layer]["expert_frequency"], dtype=np.float64)
            st = np.sort(ft)[::-1]
            per_tag.append(f"{t} {st[:q].sum() / st.sum():.2f}")
            tops.append(set(np.argsort(-ft)[:q].tolist()))
        jac = [len(a & b) / len(a | b) for i, a in enumerate(tops) for b in tops[i + 1 :]]
        lines.append(
            f"| {layer} | {s[:q].sum() / s.sum():.3f} | {s[: 2 * q].sum() / s.sum():.3f} | "
            f"{', '.join(per_tag)} | {fmt(statistics.mean(jac) if jac else None, 2)} |"
        )
    return lines


def probe_section(ref: dict | None, entries: list[tuple[str, dict]]) -> list[str]:
    """Bitwise MoE-block comparison per rank: equal digests / all (layer, size) pairs."""
    from reap_swap.engine.moe_probe import compare_probes

    if not ref or not ref.get("ranks"):
        return ["(no reference probe)"]
    lines = ["", "| run | rank | equal (layer, tokens) | differ | ranks agree |", "|---|---|---|---|---|"]
    rows = [("reference", ref)] + entries
    for name, probe in rows:
        ranks = probe.get("ranks") or []
        if not ranks:
            lines.append(f"| {name} | | failed: {json.dumps(probe.get('error'))[:200]} | | |")
            continue
        agree = all(x.get("layers") == ranks[0].get("layers") for x in ranks)
        for i, got in enumerate(ranks):
            if got.get("error"):
                lines.append(f"| {name} | {i} | error: {got['error'][:200]} | | |")
                continue
            c = compare_probes(ref["ranks"][min(i, len(ref["ranks"]) - 1)], got)
            cell = f"{c['equal']}/{c['of']}" if c["comparable"] else c["why"]
            lines.append(
                f"| {name} | {got.get('tp_rank', i)} | {cell} | {', '.join(c.get('differ', [])[:6])} | {agree} |"
            )
    return lines


def tp_section(tp: dict) -> list[str]:
    r = tp.get("reap-tp") or {}
    stock = tp.get("stock-gpu") or {}
    lines = []
    if r.get("error"):
        lines.append(f"reap-tp error: {r['error'][:500]}")

    def workers(st):
        return [
            (w.get("tp_rank"), w.get("signature"), w.get("resident_experts"))
            for w in (st or {}).get("workers", [])
        ]

    for key in ("status_start", "status_50", "status_after_fault", "status_25", "status_end"):
        st = r.get(key) or {}
        lines.append(
            f"- {key}: signature {st.get('signature')}, consistent {st.get('workers_consistent')}, "
            f"workers {workers(st)}"
        )
    for key in ("swap_50", "fault_swap", "swap_back_25"):
        sw = r.get(key) or {}
        lines.append(
            f"- {key}: HTTP {sw.get('status')}, bytes {sw.get('bytes_copied_per_worker')}, "
            f"workers {[(w.get('tp_rank'), w.get('signature')) for w in sw.get('workers') or []]}, "
            f"error {json.dumps(sw.get('error'))[:400] if sw.get('error') else None}"
        )
    lines.append(f"- fault armed: {json.dumps(r.get('fault_arm'))[:300]}")
    half = tp.get("stock-uva-half") or {}
    lines.append(
        f"- decode at 50 %: 1 stream {span((r.get('at_50') or {}).get('decode_1'))}, 8 streams "
        f"{span((r.get('at_50') or {}).get('decode_8'))}; stock TP=2 all in HBM: "
        f"{span(stock.get('decode_1'))}, 8 streams {span(stock.get('decode_8'))}; stock UVA TP=2 "
        f"with half the expert bytes offloaded: {span(half.get('decode_1'))}, 8 streams "
        f"{span(half.get('decode_8'))}"
    )
    lines.append(f"- hit rate at 50 %: {((r.get('at_50') or {}).get('router_misses') or {}).get('totals')}")
    t = r.get("swap_timings_25_50") or []
    if t:
        ins = [x["in"]["timing"]["total_seconds"] * 1000 for x in t if x["in"]["status"] == 200]
        lines.append(
            f"- swap 25 % -> 50 % (server ms): {[round(v, 1) for v in ins]}, bytes per rank "
            f"{t[0]['in'].get('bytes_copied_per_worker')}"
        )
    ref = stock.get("greedy")
    entries = [(k, (r.get(k) or {}).get("greedy")) for k in ("core", "at_50", "after_fault", "at_25")]
    stock_uva = [(k, (tp.get(k) or {}).get("greedy")) for k in ("stock-uva-all", "stock-uva-half") if k in tp]
    lines += [""] + greedy_section("stock vLLM TP=2, all experts in HBM", ref, stock_uva + entries)
    uva = (tp.get("stock-uva-all") or {}).get("greedy")
    if uva:
        lines += ["", "Against stock vLLM TP=2 with the launcher's UVA flags:"]
        lines += greedy_section("stock-uva-all TP=2", uva, entries)
    probes = [(k, (tp.get(k) or {}).get("moe_probe")) for k in ("stock-uva-all", "stock-uva-half")]
    probes += [
        (f"reap-tp {k}", (r.get(k) or {}).get("moe_probe")) for k in ("core", "at_50", "after_fault", "at_25")
    ]
    lines += ["", "MoE-layer outputs (reap_moe_probe digests) vs stock vLLM TP=2, all experts in HBM:"]
    lines += probe_section(stock.get("moe_probe"), [(k, p) for k, p in probes if p])
    lines += ["", "Counters vs vLLM routed experts (TP=2):"] + counter_section(r.get("counter_check"))
    return lines


def families_section(root: Path) -> list[str]:
    """gpu_families.sh's DIR: every DIR/<family>/family.json as one table (families_report.py),
    plus the arms that were skipped or never merged."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import families_report

    docs, missing = [], []
    for d in sorted(p for p in root.iterdir() if p.is_dir()):
        if (d / "family.json").exists():
            docs.append(json.loads((d / "family.json").read_text()))
        for skipped in sorted(d.glob("*.skipped.json")):
            missing.append(
                f"- {d.name} {skipped.name.split('.')[0]}: {json.loads(skipped.read_text())['skipped']}"
            )
        if not (d / "family.json").exists() and not list(d.glob("*.skipped.json")):
            missing.append(f"- {d.name}: no family.json (the arm was cut off or never merged)")
    pin = load(root / "pin_bench.json")
    lines = [f"## Families at full size ({root})", ""] + families_report.markdown(docs)
    if pin:
        lines += ["", f"Pinned-allocator micro-bench: chosen {pin.get('chosen')}; " + "; ".join(
            f"{r.get('setting')}: {fmt(r.get('gib_per_s'), 2)} GiB/s, UVA view ok {r.get('uva_view_ok')}"
            for r in pin.get("results", [])
        )]  # fmt: skip
    return lines + ([""] + missing if missing else [])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("session", type=Path, nargs="?")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--families", type=Path, help="a gpu_families.sh result folder")
    a = ap.parse_args()
    if a.families:
        print("\n".join(families_section(a.families)))
        return 0
    if a.session is None:
        ap.error("SESSION_DIR or --families DIR")
    e0, e1, tp = (load(a.session / d / "gpu_e2e.json") for d in ("e2e0", "e2e1", "tp"))
    stock = e0.get("stock-gpu") or {}
    sweep = e0.get("reap-sweep") or e0.get("reap-clean") or {}
    routed = e1.get("reap-routed") or {}
    out = ["## Greedy text (random model, single H200)", ""]
    entries = [
        (f"reap-sweep {k} %", (sweep.get("phases", {}).get(k) or {}).get("greedy"))
        for k in ("0", "25", "50", "100", "0b")
    ]
    entries.append(("reap-routed (core 25 % from startup)", (routed.get("core") or {}).get("greedy")))
    for name in ("stock-uva-all",):
        for src in (e0, e1):
            if name in src:
                entries.append((name, src[name].get("greedy")))
    out += greedy_section("stock vLLM, all experts in HBM", stock.get("greedy"), entries)
    uva = (e0.get("stock-uva-all") or e1.get("stock-uva-all") or {}).get("greedy")
    if uva:
        out += [
            "",
            "Against stock vLLM with the launcher's UVA flags (same kernels, every expert in host memory):",
        ]
        out += greedy_section("stock-uva-all", uva, entries[:-1])
    out += ["", "## Decode vs the bound", ""]
    lines, derived = sweep_section(sweep, stock)
    out += lines
    out += ["", "## Swap speed (server, end to end)", ""] + swap_section(sweep)
    sc = (sweep.get("selfcheck_25") or {}).get("result")
    out += ["", f"Self-check at 25 %: {json.dumps(sc)[:1500]}"]
    out += ["", "## Counters vs --enable-return-routed-experts", ""] + counter_section(
        routed.get("counter_check")
    )
    out += ["", "## Skewed model routing (observe on the calibration split)", ""] + skew_section(a.session)
    out += ["", "## TP=2", ""] + tp_section(tp)
    print("\n".join(out))
    if a.json:
        a.json.write_text(json.dumps(derived, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
