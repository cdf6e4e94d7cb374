"""Record the mini MoE's routing traces and the calibration plans the simulator compares.

    PYTHONPATH=$PWD .venv/bin/python research/sim/record_mini_trace.py                  # held-out + plans
    PYTHONPATH=$PWD .venv/bin/python research/sim/record_mini_trace.py --split calibration --skip-plans

(each about 2 min on 2 shared cores, most of it vLLM's start-up)

1. The trace corpus: the first --per-domain records of each domain of data/corpus/<split>.jsonl
   (heldout: disjoint from calibration; calibration: the trace policy parameters are tuned on),
   cut to <= 600 characters at a line boundary as in research.md's issue-7 measurement, in file
   order (python, prose, shell, c).
2. ``reap-swap observe --trace`` on it: vLLM's prefill counts (the observation file, .cache/trace)
   and the trace (prefill + 32 greedy tokens per request) -> data/traces/mini-moe-<split>.npz.
3. Unless --skip-plans: ``reap-swap observe`` on all of data/corpus/calibration.jsonl and
   ``reap-swap plan`` at 0.125 and 0.25 of expert bytes (core fraction 0.75, as
   plans/reap-mini-moe.plan.json at 0.5) -> research-notes/cache-sim/plan-<ratio>.json, so each
   simulated budget has a plan built for it from calibration data only.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import orjson

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / ".cache" / "trace"
ENGINE = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20)]
CLI = [sys.executable, "-m", "reap_swap.cli"]


def cut_corpus(split: str, per_domain: int, chars: int, out: Path) -> int:
    by_domain: dict[str, int] = defaultdict(int)
    lines = []
    for raw in (ROOT / f"data/corpus/{split}.jsonl").read_text(encoding="utf-8").splitlines():
        rec = orjson.loads(raw)
        domain = rec.get("tag") or rec.get("source") or "untagged"
        if by_domain[domain] >= per_domain:
            continue
        by_domain[domain] += 1
        text = rec["text"]
        if len(text) > chars:
            cut = text.rfind("\n", 0, chars)
            text = text[: cut if cut > chars // 2 else chars]
        lines.append(orjson.dumps({"text": text, "tag": domain, "path": rec.get("path")}))
    out.write_bytes(b"\n".join(lines) + b"\n")
    return len(lines)


def run(argv: list[str]) -> None:
    print(f"$ {shlex.join(argv)}", flush=True)
    subprocess.run(argv, cwd=ROOT, check=True)


MODEL = "models/reap-mini-moe"


def observe(corpus: Path | str, out: Path, *extra: str) -> None:
    run(
        CLI
        + ["observe", "--model", MODEL, "--corpus", str(corpus), "--out", str(out), "--no-progress"]
        + list(extra)
        + ENGINE
    )


def calibration_plans() -> None:
    """Observe all of the calibration split and plan at 12.5 % and 25 % of expert bytes."""
    calib = WORK / "calibration.pt"
    observe("data/corpus/calibration.jsonl", calib)
    for ratio in ("0.125", "0.25"):
        out = ROOT / f"research-notes/cache-sim/plan-{ratio}.json"
        run(
            CLI
            + [
                "plan",
                "--observations",
                str(calib),
                "--model",
                MODEL,
                "--model-name",
                "reap-mini-moe",
                "--budget-ratio",
                ratio,
                "--core-fraction",
                "0.75",
                "--out",
                str(out),
            ]
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--split", choices=("heldout", "calibration"), default="heldout")
    ap.add_argument("--per-domain", type=int, default=12)
    ap.add_argument("--chars", type=int, default=600)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--out", type=Path, help="default: data/traces/mini-moe-<split>.npz")
    ap.add_argument("--skip-plans", action="store_true")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    out = args.out or ROOT / f"data/traces/mini-moe-{args.split}.npz"
    corpus = WORK / f"{args.split}-trace.jsonl"
    print(f"{cut_corpus(args.split, args.per_domain, args.chars, corpus)} {args.split} prompts -> {corpus}")
    observe(
        corpus,
        WORK / f"{args.split}-trace.pt",
        "--trace",
        str(out),
        "--trace-decode-tokens",
        str(args.decode_tokens),
    )
    if not args.skip_plans:
        calibration_plans()
    return 0


if __name__ == "__main__":
    sys.exit(main())
