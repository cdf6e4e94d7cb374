"""Read a families-lane result directory and say, per family, what Model Runner V2 changed (mrv2).

No GPU, no vLLM: it reads what research/gpu/gpu_families.py left under DIR/<family>/ -- reap.json or
count.json ({"reap": {"worker_status", "counters", "count_cases", "host_startup", "argv"}}) and
reap.server.log -- and checks, per family:

- `runner`: every worker's /reap/status `runner` (compat/runner.py; absent before branch mrv2);
- on Model Runner V2 (vLLM 0.26.0), since compat/runner.install_v2_offloader: the launcher asked for
  UVA offload and vLLM's "Offloader set to UVAOffloader" line is there (reap-swap's hook set it), the
  worker's notes are empty, and the router counters are exact (`counters.equal`, every
  `count_cases[].equal`: the is_padding fix of 46f013b); `--before-hook` checks the older
  expectation (no UVA args, the launcher's "no UVA expert offload: ... Model Runner V2" line);
- on V1: the notes are empty, and UVA args and vLLM's "Offloader set to UVAOffloader" agree.

    python research/gpu/check_mrv2.py RUN/fam RUN/mlacount [--out RUN/mrv2_check.json]

Exit 0 when every expectation holds, 1 otherwise (the JSON says which).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

V2_LINE = "no UVA expert offload: "
OFFLOADER_LINE = "Offloader set to UVAOffloader"


def _results(doc: dict) -> list[dict]:
    ws = (doc.get("reap") or {}).get("worker_status") or {}
    return list(((ws.get("result") or {}).get("results")) or [])


def check_family(d: Path) -> dict | None:
    """The verdict for one family directory, or None when it holds no reap arm."""
    doc_path = next((d / n for n in ("reap.json", "count.json") if (d / n).exists()), None)
    if doc_path is None:
        return None
    doc = json.loads(doc_path.read_text())
    log_path = d / "reap.server.log"
    log = log_path.read_text(errors="replace") if log_path.exists() else ""
    reap = doc.get("reap") or {}
    runners = [r.get("runner") or {} for r in _results(doc)]
    kinds = sorted({r.get("model_runner", "absent") for r in runners}) or ["no worker status"]
    notes = [n for r in runners for n in r.get("notes", [])]
    cases = (reap.get("count_cases") or {}).get("cases") or []
    out = {
        "family": d.name,
        "model_runner": kinds,
        "padding_mask": sorted({r.get("padding_mask", "absent") for r in runners}),
        "notes": notes,
        "uva_args": "'cpu_offload_gb'" in log,
        "vllm_offloader": OFFLOADER_LINE in log,
        "launcher_no_uva_line": next((ln.strip() for ln in log.splitlines() if V2_LINE in ln), None),
        "counters_equal": (reap.get("counters") or {}).get("equal"),
        "count_cases_equal": [c.get("equal") for c in cases],
        "hbm_peak_gib": (reap.get("host_startup") or {}).get("hbm_peak_gib"),
    }
    return out


def failures(v: dict, before_hook: bool = False) -> list[str]:
    bad = []
    if v["model_runner"] not in (["v1"], ["v2"]):
        bad.append(f"model_runner {v['model_runner']} (expected one of v1 / v2 on every worker)")
    if v["notes"]:
        bad.append(f"worker notes: {v['notes']}")
    if v["counters_equal"] is not True:
        bad.append(f"counters.equal is {v['counters_equal']}")
    if not all(v["count_cases_equal"]):
        bad.append(f"count_cases equal: {v['count_cases_equal']}")
    if v["model_runner"] == ["v2"] and not before_hook:
        if not (v["uva_args"] and v["vllm_offloader"]):
            bad.append(
                f"V2: UVA args {v['uva_args']}, vLLM's offloader line {v['vllm_offloader']} "
                "(reap-swap's hook should set the offloader the launcher asks for)"
            )
    if v["model_runner"] == ["v2"] and before_hook:
        if v["uva_args"] or v["vllm_offloader"]:
            bad.append("V2: UVA offload was requested or set up (0.26.0's V2 runner creates no offloader)")
        if not (v["launcher_no_uva_line"] and "Model Runner V2" in v["launcher_no_uva_line"]):
            bad.append("V2: the launcher's 'no UVA expert offload: ... Model Runner V2' line is missing")
    if v["model_runner"] == ["v1"] and v["uva_args"] != v["vllm_offloader"]:
        bad.append(f"V1: UVA args {v['uva_args']} but vLLM's offloader line {v['vllm_offloader']}")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="families-lane output dirs (DIR/<family>/...)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--before-hook", action="store_true", help="a run from before install_v2_offloader")
    a = ap.parse_args(argv)
    verdicts = []
    for top in a.dirs:
        for d in sorted(p for p in top.iterdir() if p.is_dir()) if top.is_dir() else []:
            v = check_family(d)
            if v is not None:
                v["failures"] = failures(v, a.before_hook)
                verdicts.append(v)
    report = {"families": verdicts, "ok": bool(verdicts) and not any(v["failures"] for v in verdicts)}
    text = json.dumps(report, indent=1)
    if a.out:
        a.out.write_text(text)
    print(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
