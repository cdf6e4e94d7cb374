#!/usr/bin/env python3
"""Greedy text and logprobs of reap-swap with the device cache against stock vLLM on the same card,
under swaps in flight, after them and after a storm (issue 42's correctness defect).

The check the issue reports (kit model, near-uniform routing): plan core = experts 0..E/4-1 and
8-expert slices over the rest, pool = 50 % of expert bytes, ``--no-enable-prefix-caching``, CUDA
graphs on, one request at a time. Per arm (one server at a time):
  stock      vLLM itself: the reference (4 token-id prompts x 192 greedy tokens, ignore_eos)
  reap-*     reap-swap with the arm's flags: the same 4 completions (1) quiet, (2) while a thread posts
             /swap_active_set with 0-2 random slices per layer every 20 ms, (3) after the swaps stopped,
             (4) after a storm of 240 requests (chats, swaps, malformed payloads; 8 at a time), then
             /reap/status (cache counters, the debug shadow's per-layer record when asked).
Arms: stock, reap-default (the plan alone: the server's defaults), reap-static (--reap-cache-device off:
the plan's static set), reap-cache (--reap-cache-slots swaps + device cache), reap-off (--reap-cache
off: the control), reap-seeded (the seeded form); ARM+quiet: the quiet phase only (speed), ARM+det:
TORCHINDUCTOR_DETERMINISTIC=1, ARM+shared: the stock arm's VLLM_CACHE_ROOT; ``--shadow out|bytes`` adds the device cache's debug shadow. Every
server compiles afresh (its own VLLM_CACHE_ROOT). The storm's every fifth swap asks for every slice
on every layer: wider than a layer can pin (cut, listed in the response's ``unpinned``).

  python3 research/gpu/gpu_cache_equality.py --model /tmp/model --out DIR --arms stock,reap-cache,reap-off
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_e2e  # noqa: E402

from reap_swap.bench import server_driver as serving  # noqa: E402
from reap_swap.bench.server_driver import Server, log  # noqa: E402

TOKENS = 192
STORM = 240
N_PROMPTS = 4
ENGINE = [
    "--served-model-name", "m", "--dtype", "bfloat16", "--max-model-len", "2048", "--max-num-seqs", "8",
    "--gpu-memory-utilization", "0.35", "--moe-backend", "triton", "--no-enable-prefix-caching",
]  # fmt: skip
ARMS = {
    "reap-cache": ["--reap-cache", "lfu", "--reap-cache-device", "on", "--reap-cache-slots", "swaps"],
    "reap-off": ["--reap-cache", "off"],
    "reap-seeded": ["--reap-cache", "lfu", "--reap-cache-device", "on", "--reap-cache-seed", "seeded"],
    "reap-default": [],  # the plan alone: the server's defaults
    "reap-static": ["--reap-cache-device", "off"],  # the plan's static set: the default before issue 42
    "reap-noplan": [],  # no --reap-plan at all: the bare plan, swaps of expert ids
}
NO_PLAN = ("reap-noplan",)


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(42)
    return [[rng.randrange(100, vocab - 100) for _ in range(24 + 8 * i)] for i in range(N_PROMPTS)]


def complete(url: str, ids: list[int]) -> dict:
    body = {
        "model": "m",
        "prompt": ids,
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
    }
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    seconds = time.perf_counter() - t0
    r.raise_for_status()
    ch = r.json()["choices"][0]
    toks = ch["logprobs"]["tokens"]
    return {
        "text": ch["text"],
        "tokens": toks,
        "logprobs": ch["logprobs"]["token_logprobs"],
        "seconds": seconds,
        "tok_s": len(toks) / seconds,  # prompt included: a few dozen tokens against 192 decoded
    }


def run_all(url: str, ps: list[list[int]]) -> list[dict]:
    return [complete(url, p) for p in ps]


def equal(ref: list[dict], got: list[dict]) -> dict:
    c = serving.compare(ref, got)
    c["logprobs_equal"] = sum(a["logprobs"] == b["logprobs"] for a, b in zip(ref, got))
    return c


class Swapper(threading.Thread):
    """Posts /swap_active_set with 0-2 random slices per layer every ``period_s`` until stopped."""

    def __init__(self, url: str, plan: dict, seed: int, period_s: float = 0.02, by_id: bool = False) -> None:
        super().__init__(daemon=True)
        self.url, self.period_s, self.rng = url, period_s, random.Random(seed)
        # a server without a plan refuses slices: there a swap names expert ids
        self.layers = {
            k: _expert_ids(v) if by_id else [s["sliceId"] for s in v["sliceCatalog"]]
            for k, v in plan["perLayer"].items()
        }
        self.by_id = by_id
        self.halt = threading.Event()
        self.codes: dict[int, int] = {}
        self.bytes = 0
        self.n = 0

    def body(self) -> dict:
        if self.by_id:  # 0-16 experts per layer: a slice's 0-2 x 8
            active = {k: self.rng.sample(v, 8 * self.rng.randint(0, 2)) for k, v in self.layers.items()}
            return {"request_id": f"sw-{self.n}", "phase": "prefill", "active_set": active}
        active = {k: self.rng.sample(v, self.rng.randint(0, 2)) for k, v in self.layers.items()}
        return {"request_id": f"sw-{self.n}", "phase": "prefill", "active_set": active}

    def run(self) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.halt.is_set():
                self.n += 1
                r = c.post(self.url + "/swap_active_set", json=self.body())
                self.codes[r.status_code] = self.codes.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    self.bytes += int(r.json().get("bytes_copied") or 0)
                time.sleep(self.period_s)


def _expert_ids(layer: dict) -> list[int]:
    ids = set(layer.get("coreExperts") or [])
    for sl in layer["sliceCatalog"]:
        ids.update(sl["experts"])
    return sorted(ids)


MALFORMED = [
    b"{not json",
    json.dumps({"request_id": "bad1", "active_set": {"layer_0": ["nope"]}}).encode(),
    json.dumps({"request_id": "bad2", "active_set": {"layer_999": [1]}}).encode(),
    json.dumps({"request_id": "bad3", "active_set": {"layer_0": [-1]}}).encode(),
    json.dumps({"request_id": "bad4", "active_set": [1, 2]}).encode(),
    json.dumps({"active_set": {}}).encode(),
    json.dumps({"request_id": "bad5", "active_set": {}, "budget_bytes": 10**15}).encode(),
]


def storm(url: str, plan: dict, n: int = 240, by_id: bool = False) -> dict:
    """n requests, 8 at a time: chats, swaps and malformed payloads; status codes counted."""
    sw = Swapper(url, plan, seed=7, by_id=by_id)
    rng = random.Random(3)
    unpinned: list[int] = []

    def one(i: int) -> int:
        kind = i % 3
        with httpx.Client(timeout=300) as c:
            if kind == 0:
                body = {
                    "model": "m",
                    "messages": [{"role": "user", "content": f"count to {i}"}],
                    "max_tokens": 24,
                }
                return c.post(url + "/v1/chat/completions", json=body).status_code
            if kind == 1:
                sw.n = i
                body = sw.body()
                if i % 5 == 1:  # every slice on every layer: wider than a layer can pin
                    body["active_set"] = {k: list(v) for k, v in sw.layers.items()}
                r = c.post(url + "/swap_active_set", json=body)
                if r.status_code == 200 and r.json().get("unpinned"):
                    unpinned.append(sum(len(v) for v in r.json()["unpinned"].values()))
                return r.status_code
            raw = MALFORMED[rng.randrange(len(MALFORMED))]
            return c.post(
                url + "/swap_active_set", content=raw, headers={"content-type": "application/json"}
            ).status_code

    with ThreadPoolExecutor(8) as ex:
        codes = list(ex.map(one, range(n)))
    out: dict[str, int] = {}
    for code in codes:
        out[str(code)] = out.get(str(code), 0) + 1
    out["wide_swaps_cut"] = len(unpinned)
    out["unpinned_experts_each"] = sorted(set(unpinned))
    return out


def arm_reap(
    name: str, argv: list[str], out: Path, plan: dict, ps, ref, res: dict, env: dict, quiet_only: bool = False
) -> None:
    r = res.setdefault(name, {})
    with Server(name, argv, out, env=env, port=serving.free_port(), startup_timeout_s=600) as srv:
        r["startup_s"], r["argv"] = srv.startup_s, srv.command
        r["quiet"] = run_all(srv.url, ps)
        r["quiet_tok_s"] = sorted(x["tok_s"] for x in r["quiet"])
        cache = httpx.get(srv.url + "/reap/status", timeout=60).json().get("cache") or {}
        r["cache_form"] = {k: cache.get(k) for k in ("engaged", "mode", "policy", "seed", "pin_capacity")}
        log(name, "tok/s", r["quiet_tok_s"], "cache", json.dumps(r["cache_form"])[:400])
        if quiet_only:
            r["equal"] = {"quiet": equal(ref, r["quiet"])} if ref else {}
            return
        by_id = name.partition("+")[0] in NO_PLAN
        sw = Swapper(srv.url, plan, seed=1, by_id=by_id)
        sw.start()
        time.sleep(0.5)
        r["during"] = run_all(srv.url, ps)
        sw.halt.set()
        sw.join()
        r["swaps"] = {"posted": sw.n, "codes": sw.codes, "bytes": sw.bytes}
        r["after"] = run_all(srv.url, ps)
        r["status_after"] = httpx.get(srv.url + "/reap/status", timeout=60).json()
        r["storm_codes"] = storm(srv.url, plan, STORM, by_id=by_id)
        r["after_storm"] = run_all(srv.url, ps)
        r["status"] = httpx.get(srv.url + "/reap/status", timeout=60).json()
    if ref:
        r["equal"] = {ph: equal(ref, r[ph]) for ph in ("quiet", "during", "after", "after_storm")}
        log(name, json.dumps({ph: (v["identical"], v["logprobs_equal"]) for ph, v in r["equal"].items()}))
    cache = (r["status"] or {}).get("cache") or {}
    log(name, "swaps", json.dumps(r["swaps"]), "storm", json.dumps(r["storm_codes"]))
    log(
        name,
        "cache totals",
        json.dumps(cache.get("totals")),
        "shadow",
        json.dumps(cache.get("shadow"))[:3000],
    )


def main() -> None:
    global TOKENS, ENGINE, STORM
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/model")
    ap.add_argument("--out", default="eq")
    ap.add_argument("--arms", default="stock,reap-cache,reap-off")
    ap.add_argument("--shadow", choices=["off", "out", "bytes"], default="off")
    ap.add_argument("--core", type=float, default=0.25)
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--storm", type=int, default=240)
    ap.add_argument("--engine", help="replace the engine arguments (shell-quoted; e.g. a CPU smoke test)")
    args = ap.parse_args()
    TOKENS, STORM = args.tokens, args.storm
    ENGINE = shlex.split(args.engine) if args.engine else ENGINE
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model)
    vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 32000)
    ps = prompts(vocab)
    plan_path = out / "plan.json"
    plan = gpu_e2e.make_plan(model, args.core, 8, plan_path, budget_fraction=args.budget)
    path = out / "equality.json"
    res = json.loads(path.read_text()) if path.exists() else {}
    env = {"VLLM_SERVER_DEV_MODE": "1"}
    for arm in args.arms.split(","):
        t0 = time.time()
        log("arm", arm)
        try:
            if arm.startswith("stock"):
                argv = [
                    sys.executable,
                    "-m",
                    "vllm.entrypoints.openai.api_server",
                    "--model",
                    str(model),
                    *ENGINE,
                ]
                fresh = {
                    "VLLM_CACHE_ROOT": f"/tmp/vcache-{arm}"
                }  # every process compiles (and autotunes) itself
                with Server(
                    arm, argv, out, env=fresh, port=serving.free_port(), startup_timeout_s=600
                ) as srv:
                    res[arm] = {"quiet": run_all(srv.url, ps), "startup_s": srv.startup_s}
                res[arm]["quiet_tok_s"] = sorted(x["tok_s"] for x in res[arm]["quiet"])
                log(arm, "tok/s", res[arm]["quiet_tok_s"])
                if arm != "stock" and "stock" in res:
                    res[arm]["equal"] = equal(res["stock"]["quiet"], res[arm]["quiet"])
                    log(arm, json.dumps(res[arm]["equal"]))
            else:
                base, *variants = arm.split("+")
                flags = list(ARMS[base]) + (
                    ["--reap-cache-shadow", args.shadow]
                    if args.shadow != "off" and base != "reap-off"
                    else []
                )
                argv = [
                    sys.executable,
                    "-m",
                    "reap_swap.server",
                    str(model),
                    *ENGINE,
                    *([] if base in NO_PLAN else ["--reap-plan", str(plan_path)]),
                    *flags,
                ]
                # +shared: the stock arm's compile cache, as two servers on one host share
                # ~/.cache/vllm by default (the reporter's setup is not known to have isolated them)
                root = "/tmp/vcache-stock" if "shared" in variants else f"/tmp/vcache-{arm}"
                e = dict(env, VLLM_CACHE_ROOT=root)
                e = dict(e, TORCHINDUCTOR_DETERMINISTIC="1") if "det" in variants else e
                ref = (res.get("stock") or {}).get("quiet")
                arm_reap(arm, argv, out, plan, ps, ref, res, e, quiet_only="quiet" in variants)
        except Exception as exc:  # keep going with the next arm
            log(arm, "FAILED", repr(exc)[:3000])
            res.setdefault(arm, {})["error"] = repr(exc)[:5000]
        res.setdefault(arm, {})["wall_s"] = time.time() - t0
        path.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    serving.stop_servers_on_sigterm()
    main()
