#!/usr/bin/env python3
"""Issue 17's decode guard on one GPU: with every expert resident (and the cache compiled in),
single-stream decode >= 0.97 of stock vLLM, from one run.

Arms, all on the kit's mk_model (/tmp/model), CUDA graphs on, gpu_e2e.py's flags plus a fixed KV
cache (`--kv-cache-memory-bytes`, so servers side by side do not disturb each other's memory
profiling) and a small --gpu-memory-utilization:
  stock       stock vLLM, every expert in HBM
  reap        reap-swap, a plan whose core is every expert (pool = all experts, filled at startup)
  reap-cache  the same with --reap-cache lfu --reap-cache-device on --reap-cache-slots auto: with
              no slots beyond the pinned set the cache must say "not engaged" (/reap/status) and
              cost nothing
Method (the 10-minute budget: a server of mk_model starts in ~1.5-2.5 min): a *serve* starts the
three servers at once and waits until all are healthy; then `--rounds` rounds, each timing one
single-stream greedy completion of `--tokens` tokens per arm, arms interleaved (stock, reap,
reap-cache, then rotated), one arm at a time while the others idle; then all three stop. `--serves`
serves (a second only if it fits the deadline). Reported: the median over every (serve, round)
sample pooled and the median of per-serve medians, with ratios to stock (reap_swap.guard_report).
Usage: python3 scripts/gpu_guards.py --model /tmp/model --out DIR [--serves 2 --rounds 7 --deadline 480]
Writes DIR/guards.json, DIR/guards.md, DIR/guards.log and each server's log.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gpu_e2e  # noqa: E402

from reap_swap import serving  # noqa: E402
from reap_swap.guard_report import decode_markdown, decode_summary  # noqa: E402

ARMS = ("stock", "reap", "reap-cache")
CACHE_FLAGS = ["--reap-cache", "lfu", "--reap-cache-device", "on", "--reap-cache-slots", "auto"]
log = logging.getLogger("guards")


def commands(model: Path, out: Path, kv_gib: float, util: float) -> dict[str, list[str]]:
    common = [a for a in gpu_e2e.COMMON]
    common[common.index("--gpu-memory-utilization") + 1] = str(util)
    common += ["--kv-cache-memory-bytes", str(int(kv_gib * 2**30))]
    plan = out / "plan-all-resident.json"
    gpu_e2e.make_plan(model, 1.0, 8, plan, budget_fraction=1.0)  # core = every expert
    reap = [sys.executable, "-m", "reap_swap.server", str(model), *common, "--reap-plan", str(plan)]
    return {
        "stock": [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *common],
        "reap": [*reap, "--reap-cache", "off"],
        "reap-cache": [*reap, *CACHE_FLAGS],
    }


def one_decode(url: str, tokens: int, prompt: str) -> float | None:
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    return serving.batch_decode_tok_s(serving.stream_all(url, "/v1/completions", [body], timeout=120))


def reap_facts(url: str) -> dict:
    """What /reap/status says about residency and the cache (the guard needs both)."""
    st = httpx.get(url + "/reap/status", timeout=60).json()
    keys = ("resident_experts", "resident_bytes", "budget_bytes", "signature", "mode", "cache")
    return {k: st.get(k) for k in keys}


def serve(s: int, cmds: dict, out: Path, rounds: int, tokens: int, samples: list, facts: dict) -> None:
    with ExitStack() as stack:
        ports: set[int] = set()
        while len(ports) < len(ARMS):
            ports.add(serving.free_port())
        servers = {a: serving.Server(f"{a}-s{s}", cmds[a], out, port=p) for a, p in zip(ARMS, sorted(ports))}
        for srv in servers.values():  # stopped however the serve ends
            stack.callback(srv.stop, check=False)
        t0 = time.monotonic()
        errors: dict[str, Exception] = {}

        def start(arm: str) -> None:
            try:
                servers[arm].start()
            except Exception as exc:  # reported below; the others still stop
                errors[arm] = exc

        threads = [threading.Thread(target=start, args=(a,)) for a in ARMS]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"serve {s}: {', '.join(f'{a}: {e}' for a, e in errors.items())}"[:4000])
        log.info("serve %d: all healthy after %.0f s", s, time.monotonic() - t0)
        for arm in ("reap", "reap-cache"):
            facts.setdefault(arm, []).append({"serve": s, **reap_facts(servers[arm].url)})
        for srv in servers.values():  # warm-up (first request after graphs: not timed)
            one_decode(srv.url, 16, "warm up")
        for r in range(rounds):
            order = ARMS[r % 3 :] + ARMS[: r % 3]
            for arm in order:
                rate = one_decode(servers[arm].url, tokens, gpu_e2e.PROMPTS[r % len(gpu_e2e.PROMPTS)])
                samples.append({"arm": arm, "serve": s, "round": r, "tok_s": rate})
                log.info("serve %d round %d %-10s %.1f tok/s", s, r, arm, rate or 0.0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--serves", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--util", type=float, default=0.3)
    ap.add_argument("--deadline", type=float, default=480.0, help="no new serve after this many seconds")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.FileHandler(out / "guards.log"), logging.StreamHandler()])  # fmt: skip
    cmds = commands(Path(args.model), out, args.kv_gib, args.util)
    samples: list[dict] = []
    facts: dict = {}
    doc = {"args": vars(args), "commands": cmds, "samples": samples, "facts": facts, "serve_wall_s": []}
    try:
        serves(args, cmds, out, samples, facts, doc)
    except SystemExit:  # serving.stop_servers_on_sigterm: the serve's servers stopped on the way out
        doc["cut"] = "SIGTERM during a serve (gpu_run.sh's GUARD_CAP); its samples so far are kept"
        raise
    finally:  # also when `timeout` (gpu_run.sh's GUARD_CAP) cuts a serve: what was sampled is summarised
        finish(doc, samples, facts, out)
    return 0 if samples and "errors" not in doc else 1


def serves(args, cmds: dict, out: Path, samples: list, facts: dict, doc: dict) -> None:
    t_start = time.monotonic()
    for s in range(args.serves):
        elapsed = time.monotonic() - t_start
        last = doc["serve_wall_s"][-1] if doc["serve_wall_s"] else 0.0
        if s and elapsed + last > args.deadline:
            doc["skipped_serves"] = (
                f"{args.serves - s} (deadline {args.deadline:.0f} s, one serve took {last:.0f} s)"
            )
            log.info("skipping the remaining serves: %s", doc["skipped_serves"])
            break
        t = time.monotonic()
        try:
            serve(s, cmds, out, args.rounds, args.tokens, samples, facts)
        except Exception as exc:
            log.error("serve %d failed: %r", s, exc)
            doc.setdefault("errors", []).append(repr(exc)[:4000])
        doc["serve_wall_s"].append(time.monotonic() - t)
        (out / "guards.json").write_text(json.dumps(doc, indent=1))


def finish(doc: dict, samples: list, facts: dict, out: Path) -> None:
    doc["summary"] = summary = decode_summary(samples)
    doc["what"] = (
        "single-stream decode tok/s of one greedy completion per (serve, round, arm); 'pooled' = median "
        "over all samples of an arm; 'serve_medians' = median of the per-serve medians"
    )
    (out / "guards.json").write_text(json.dumps(doc, indent=1))
    (out / "guards.md").write_text(decode_markdown(summary) + "\n")
    log.info("\n%s", decode_markdown(summary))
    log.info("reap-cache status: %s", json.dumps(facts.get("reap-cache"))[:1500])


if __name__ == "__main__":
    serving.stop_servers_on_sigterm()
    sys.exit(main())
