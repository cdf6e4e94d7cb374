#!/usr/bin/env python3
"""Issue 17's decode guard on one GPU: with every expert resident (and the cache compiled in),
single-stream decode >= 0.97 of stock vLLM, from one run.

Arms, all on the kit's mk_model (/tmp/model), CUDA graphs on, gpu_e2e.py's flags plus a fixed KV
cache (`--kv-cache-memory-bytes`, so servers side by side do not disturb each other's memory
profiling) and a small --gpu-memory-utilization:
  stock       stock vLLM, every expert in HBM
  reap        reap-swap, a plan whose core is every expert (pool = all experts, filled at startup)
  reap-cache  the same experts, all resident and pinned, with --reap-cache lfu --reap-cache-device on
              and an explicit tail of --cache-slots-per-layer slots per layer beyond them (its own
              plan, pool = every expert + the tail): the device cache ENGAGES on every layer and runs
              its policy step, the id remap and the kernel over E + N units every step, with every
              routed expert a hit. Run 12's arm used --reap-cache-slots auto on a pool of exactly
              every expert: 0 slots beyond the pinned set, so it never engaged and measured nothing
              about a running cache. A serve whose cache arm did not engage on every layer (or ran
              no cache step) is not timed for that arm and the guard reads "not measured".
Method: a *serve* starts the three servers at once and waits until all are healthy; each server
gets `--warmup` untimed completions; then `--rounds` rounds, each timing one single-stream greedy
completion of `--tokens` tokens (ignore_eos) per arm, arms interleaved (rotated each round), one arm
at a time while the others idle; then all three stop. `--serves` serves (a next one only if it fits
the deadline). Reported (reap_swap.bench.guards): per arm the pooled median, the per-serve medians
and their median, and the paired reading: per (serve, round) the arm's rate / stock's rate of the
same round, median per serve and the median of those (removes the drift that moved every arm of a
round together in run 12: 352-639 tok/s).
Usage: python3 research/gpu/gpu_guards.py --model /tmp/model --out DIR [--serves 2 --rounds 12 --tokens 512 --deadline 480]
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
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import gpu_e2e  # noqa: E402

from reap_swap.bench import server_driver as serving  # noqa: E402
from reap_swap.bench.guards import cache_not_engaged, decode_markdown, decode_summary  # noqa: E402

ARMS = ("stock", "reap", "reap-cache")
CACHE_ARM = "reap-cache"
CACHE_FLAGS = ["--reap-cache", "lfu", "--reap-cache-device", "on", "--reap-cache-slots"]  # + N
log = logging.getLogger("guards")


def commands(
    model: Path, out: Path, kv_gib: float, util: float, slots_per_layer: int = 8, seed: str = "pinned"
) -> dict[str, list[str]]:
    """The three arms' argv. pinned (core+dlfu): the cache arm's plan budgets every expert +
    `slots_per_layer` per layer (the pool's tail beyond the pinned set, lent to the device cache:
    device_cache_engine.split). seeded (dlfu-seeded): the all-resident plan, every pool slot a cache
    slot seeded with the core (E slots per layer, `--reap-cache-slots auto`)."""
    common = [a for a in gpu_e2e.COMMON]
    common[common.index("--gpu-memory-utilization") + 1] = str(util)
    common += ["--kv-cache-memory-bytes", str(int(kv_gib * 2**30))]
    plan = out / "plan-all-resident.json"
    gpu_e2e.make_plan(model, 1.0, 8, plan, budget_fraction=1.0)  # core = every expert
    shape = gpu_e2e.model_shape(model)
    tail_plan = out / "plan-all-resident-tail.json"
    doc = gpu_e2e.make_plan(model, 1.0, 8, tail_plan, budget_fraction=1.0)
    budget = doc["budget"]  # exactly layers x (E + N) experts (a float fraction could round one short)
    budget["swappable_expert_budget_bytes"] = (
        shape["layers"] * (shape["experts"] + slots_per_layer) * shape["per_expert"]
    )
    budget["specialist_budget_bytes"] = budget["swappable_expert_budget_bytes"] - budget["core_budget_bytes"]
    tail_plan.write_text(json.dumps(doc))
    server = [sys.executable, "-m", "reap_swap.server", str(model), *common, "--reap-plan"]
    tail = str(slots_per_layer * shape["layers"])
    return {
        "stock": [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *common],
        "reap": [*server, str(plan), "--reap-cache", "off"],
        CACHE_ARM: [*server, str(tail_plan), *CACHE_FLAGS, tail]
        if seed == "pinned"
        else [*server, str(plan), *CACHE_FLAGS, "auto", "--reap-cache-seed", "seeded"],
    }


def expected_slots(a: argparse.Namespace, model: Path) -> int:
    """Cache slots per layer the cache arm must show in /reap/status."""
    return a.cache_slots_per_layer if a.cache_seed == "pinned" else gpu_e2e.model_shape(model)["experts"]


def one_decode(url: str, tokens: int, prompt: str) -> float | None:
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    return serving.batch_decode_tok_s(serving.stream_all(url, "/v1/completions", [body], timeout=120))


def reap_facts(url: str) -> dict:
    """What /reap/status says about residency and the cache (the guard needs both)."""
    st = httpx.get(url + "/reap/status", timeout=60).json()
    keys = ("resident_experts", "resident_bytes", "budget_bytes", "signature", "mode", "cache")
    return {k: st.get(k) for k in keys}


def start_all(s: int, cmds: dict, out: Path, stack: ExitStack) -> dict:
    """The serve's three servers, started at once; each stopped however the serve ends."""
    ports: set[int] = set()
    while len(ports) < len(ARMS):
        ports.add(serving.free_port())
    servers = {a: serving.Server(f"{a}-s{s}", cmds[a], out, port=p) for a, p in zip(ARMS, sorted(ports))}
    for srv in servers.values():
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
    return servers


def serve(s: int, cmds: dict, out: Path, a: argparse.Namespace, samples: list, facts: dict) -> None:
    with ExitStack() as stack:
        servers = start_all(s, cmds, out, stack)
        for arm in ("reap", CACHE_ARM):
            facts.setdefault(arm, []).append({"serve": s, "when": "start", **reap_facts(servers[arm].url)})
        why = cache_not_engaged(facts[CACHE_ARM][-1].get("cache"), a.expect_layers, a.expect_slots)
        arms = ARMS if why is None else tuple(x for x in ARMS if x != CACHE_ARM)
        if why is not None:  # refuse to time a cache arm whose cache is not running
            log.error("serve %d: %s not timed: %s", s, CACHE_ARM, why)
            facts.setdefault("not_engaged", []).append({"serve": s, "reason": why})
        for arm in arms:  # warm-up on the timed prompts: the first requests after capture are not timed
            for i in range(a.warmup):
                one_decode(servers[arm].url, 64, gpu_e2e.PROMPTS[i % len(gpu_e2e.PROMPTS)])
        for r in range(a.rounds):
            k = r % len(arms)
            for arm in arms[k:] + arms[:k]:
                rate = one_decode(servers[arm].url, a.tokens, gpu_e2e.PROMPTS[r % len(gpu_e2e.PROMPTS)])
                samples.append({"arm": arm, "serve": s, "round": r, "tok_s": rate})
                log.info("serve %d round %d %-10s %.1f tok/s", s, r, arm, rate or 0.0)
        if why is None:  # the cache ran: steps counted on the device during the timed rounds
            end = {"serve": s, "when": "end", **reap_facts(servers[CACHE_ARM].url)}
            facts[CACHE_ARM].append(end)
            ran = cache_not_engaged(end.get("cache"), a.expect_layers, a.expect_slots, ran=True)
            misses = ((end.get("cache") or {}).get("totals") or {}).get("expert_misses")
            if misses:  # every expert is resident: a miss means the cache's pinned/seeded set is wrong
                log.warning(
                    "serve %d: %s counted %s expert misses with every expert resident", s, CACHE_ARM, misses
                )
            if ran is not None:
                log.error("serve %d: %s samples dropped: %s", s, CACHE_ARM, ran)
                facts.setdefault("not_engaged", []).append({"serve": s, "reason": ran})
                samples[:] = [x for x in samples if not (x["serve"] == s and x["arm"] == CACHE_ARM)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/model")
    ap.add_argument("--out", required=True)
    ap.add_argument("--serves", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=512, help="decode tokens per sample (ignore_eos)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed completions per server per serve")
    ap.add_argument("--cache-slots-per-layer", type=int, default=8, help="the cache arm's tail per layer")
    ap.add_argument(
        "--cache-seed", choices=("pinned", "seeded"), default="pinned",
        help="the cache arm's --reap-cache-seed (seeded: every expert a cache slot, seeded with the core)",
    )  # fmt: skip
    ap.add_argument("--kv-gib", type=float, default=2.0)
    ap.add_argument("--util", type=float, default=0.3)
    ap.add_argument("--deadline", type=float, default=480.0, help="no new serve after this many seconds")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.FileHandler(out / "guards.log"), logging.StreamHandler()])  # fmt: skip
    cmds = commands(
        Path(args.model), out, args.kv_gib, args.util, args.cache_slots_per_layer, args.cache_seed
    )
    args.expect_layers = gpu_e2e.model_shape(Path(args.model))["layers"]
    args.expect_slots = expected_slots(args, Path(args.model))
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
            serve(s, cmds, out, args, samples, facts)
        except Exception as exc:
            log.error("serve %d failed: %r", s, exc)
            doc.setdefault("errors", []).append(repr(exc)[:4000])
        doc["serve_wall_s"].append(time.monotonic() - t)
        (out / "guards.json").write_text(json.dumps(doc, indent=1))


def finish(doc: dict, samples: list, facts: dict, out: Path) -> None:
    ne = facts.get("not_engaged") or []
    timed = any(x["arm"] == CACHE_ARM for x in samples)  # a serve that engaged still counts
    refused = {CACHE_ARM: ne[-1]["reason"]} if ne and not timed else {}
    doc["cache_not_engaged_serves"] = [x["serve"] for x in ne]
    doc["summary"] = summary = decode_summary(samples, refused=refused)
    doc["what"] = (
        "single-stream decode tok/s of one greedy completion per (serve, round, arm); 'pooled' = median "
        "over all samples of an arm; 'serve_medians' = median of the per-serve medians; 'paired' = "
        "median over serves of the per-serve median of (arm / stock of the same round)"
    )
    (out / "guards.json").write_text(json.dumps(doc, indent=1))
    (out / "guards.md").write_text(decode_markdown(summary) + "\n")
    log.info("\n%s", decode_markdown(summary))
    log.info("reap-cache status: %s", json.dumps(facts.get(CACHE_ARM))[:1500])


if __name__ == "__main__":
    serving.stop_servers_on_sigterm()
    sys.exit(main())
