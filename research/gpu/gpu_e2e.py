#!/usr/bin/env python3
"""End-to-end checks of reap-swap on GPUs against stock vLLM (one server at a time per call).

Arms (each: start a server, measure, stop; results merged into OUT/gpu_e2e.json):
  stock-gpu       stock vLLM, every expert in HBM: greedy text, decode tok/s (1 and 8 streams)
  stock-uva-all   stock vLLM with the flags the reap-swap launcher sets (every expert in pinned host
                  memory, UVA): the same-kernel reference for greedy text
  stock-uva-half  stock vLLM, --cpu-offload-gb = half the expert bytes (layer-granular)
  reap-sweep      reap-swap, plan with an empty core and a pool for every expert; swaps to 25, 50,
                  100 and back to 0 % resident, with greedy text, decode tok/s and the router hit
                  rate at each, the engine self-check, then timed swaps of 1 %, 10 %, 1 GiB and
                  100 % of the pool and a no-op swap
  reap-routed     reap-swap with the plan core (25 %) filled at startup and vLLM's
                  --enable-return-routed-experts: our CUDA-graph counters vs vLLM's own per-token
                  routed experts, request by request
  reap-cache      reap-swap, plan core 25 %, pool 50 %, the device cache on the tail
                  (--reap-cache lfu --reap-cache-device on): greedy text, decode, cache counters
                  (/reap/status) and router misses of a plain client (no swap calls), issue 17
  reap-plan25     the same plan and pool with --reap-cache off: the plain client's static core
  reap-cache-nocore  reap-cache on a plan with an EMPTY core (pool 50 %): the pinned form with nothing
                  pinned, every own unit host-backed and E + N = 192 units -- the layout of the seeded
                  serve that differed from stock in run 12, without seeding; and what
                  `reap-swap plan --cache-tail auto` serves at small budgets (research.md "cachetail")
  reap-cache-seeded  the same plan and pool with --reap-cache-seed seeded (dlfu-seeded: every layer's
                  core + tail share is cache slots seeded with the core, evictable): the plain client,
                  then swaps pinned inside the slots (core + q/2, core + q per layer: the whole share),
                  one layer one past its share (refused by name), back to the core; greedy text and
                  cache status at each (served on CUDA whenever asked since run 23; refused there
                  from run 12 until then)
  reap-tp         (with --tp 2) reap-swap, core 25 %, pool 50 %: per-rank status, counters vs
                  routed experts, swap to 50 %, a failure injected on rank 1 mid-swap (both ranks
                  must stay on the previous set), swaps back, greedy text throughout
Every arm runs with CUDA graphs on (no --enforce-eager) unless --eager. Greedy outputs are stored
per arm/phase; research/gpu/gpu_summarize.py compares them across arms and files.

With --moe-probe, stock arms also load reap_swap.engine.moe_probe.MoeProbeExtension (a worker mixin that
changes nothing else) and every arm/phase records reap_moe_probe: a digest of each MoE block's
output for the same seeded input on every rank, compared bitwise across arms by gpu_summarize.py.

Usage (on the device, after installing the kit):
  python3 research/gpu/gpu_e2e.py --model /tmp/model --out DIR --arms stock-gpu,reap-sweep [--tp 2]
  PP=2 (issue 18; needs 2 GPUs; NOT run on a GPU yet, the arms are the TP ones unchanged):
  python3 research/gpu/gpu_e2e.py --model /tmp/model --out DIR --pp 2 --moe-probe \
      --arms stock-gpu,stock-uva-half,reap-tp
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shlex
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo, when not on PYTHONPATH
from reap_swap.bench import server_driver as serving  # noqa: E402
from reap_swap.bench.server_driver import Server, compare, log  # noqa: E402

PROMPTS = [
    "The history of the printing press",
    "def quicksort(items):",
    "Explain how a transformer model",
    "In a small village by the sea,",
    "The capital of France is",
    "SELECT name, count(*) FROM",
    "Photosynthesis converts light into",
    "Once upon a time there was a",
]
COMMON = [
    "--served-model-name",
    "m",
    "--dtype",
    "bfloat16",
    "--max-model-len",
    "2048",
    "--max-num-seqs",
    "8",
    "--gpu-memory-utilization",
    "0.35",
    "--moe-backend",
    "triton",
]
DEV = {"VLLM_SERVER_DEV_MODE": "1"}  # vLLM's /collective_rpc (self-check, fault injection)


def model_shape(model: Path) -> dict:
    """The MoE shape of any family reap_swap.sizing.model_shape reads; "moe_layers" are the plan layers."""
    from reap_swap.sizing.model_shape import read_model_shape

    s = read_model_shape(model)
    return {
        "family": s.family,
        "layers": len(s.moe_layers),
        "moe_layers": list(s.moe_layers),
        "experts": s.num_experts,
        "top_k": s.top_k,
        "per_expert": s.expert_bytes,
        "expert_gib": s.total_expert_bytes / 2**30,
    }


def make_plan(
    model: Path, core_fraction: float, slice_size: int, out: Path, budget_fraction: float = 1.0
) -> dict:
    """A plan for a random model: core = the first experts of each layer, slices over the rest."""
    s = model_shape(model)
    layers, experts, per_expert = s["layers"], s["experts"], s["per_expert"]
    n_core = int(experts * core_fraction)
    per_layer = {}
    for layer in s["moe_layers"]:
        rest = list(range(n_core, experts))
        slices = [
            {
                "sliceId": f"layer_{layer}_slice_{i:02d}",
                "experts": rest[j : j + slice_size],
                "byteCost": len(rest[j : j + slice_size]) * per_expert,
            }
            for i, j in enumerate(range(0, len(rest), slice_size))
        ]
        per_layer[f"layer_{layer}"] = {
            "rawLayerKey": str(layer),
            "numExperts": experts,
            "coreExperts": list(range(n_core)),
            "coreByteCost": n_core * per_expert,
            "sliceCatalog": slices,
        }
    budget = int(layers * experts * budget_fraction) * per_expert
    core = layers * n_core * per_expert
    plan = {
        "mode": "dynamic_core_specialist",
        "model": str(model),
        "budget": {
            "per_expert_bytes": per_expert,
            "swappable_expert_budget_bytes": budget,
            "core_budget_bytes": core,
            "specialist_budget_bytes": budget - core,
            "max_refreshes_per_request": 4,
        },
        "perLayer": per_layer,
    }
    out.write_text(json.dumps(plan))
    return plan


def first_experts(shape: dict, count: int, start: int = 0) -> dict:
    """An active set of `count` experts per layer: ids start..start+count-1 of every layer."""
    return {f"layer_{layer}": list(range(start, start + count)) for layer in shape["moe_layers"]}


def spread_experts(shape: dict, total: int) -> dict:
    """An active set of `total` experts over the whole model, filling layer after layer."""
    out, left = {}, total
    for layer in shape["moe_layers"]:
        take = min(left, shape["experts"])
        out[f"layer_{layer}"] = list(range(take))
        left -= take
    return out


GREEDY_TOKENS = 48  # --greedy-tokens


def greedy(url: str, max_tokens=None) -> list[dict]:
    return serving.greedy_completions(url, PROMPTS, max_tokens=8 if QUICK else max_tokens or GREEDY_TOKENS)


QUICK = False  # --quick: smoke-test sizes


def decode_speed(url: str, batch: int, n=256, repeats=3) -> dict:
    if QUICK:
        n, repeats = 8, 1
    wait_quiet()
    return serving.decode_speed(url, PROMPTS, batch, n=n, repeats=repeats)


def wait_quiet(limit_s: float = 300.0) -> None:
    """With E2E_QUIET_FILE set, time nothing until that file exists (another lane's start-up is
    over), so CPU-heavy work on the same host does not leak into decode timings."""
    path = os.environ.get("E2E_QUIET_FILE")
    t0 = time.time()
    while path and not os.path.exists(path) and time.time() - t0 < limit_s:
        time.sleep(1)


def post(srv: Server, path: str, body: dict, timeout=600) -> tuple[int, dict, float]:
    t0 = time.perf_counter()
    r = httpx.post(srv.url + path, json=body, timeout=timeout)
    ms = (time.perf_counter() - t0) * 1000
    try:
        data = r.json()
    except ValueError:
        data = {"text": r.text[:2000]}
    return r.status_code, data, ms


def swap(srv: Server, rid: str, active_set: dict, **extra) -> dict:
    code, data, ms = post(
        srv, "/swap_active_set", {"request_id": rid, "phase": "prefill", "active_set": active_set, **extra}
    )
    brief = {
        k: data.get(k) for k in ("bytes_copied", "bytes_copied_per_worker", "noop", "signature", "workers")
    }
    timing = data.get("timing") or {}
    out = {"status": code, "client_ms": ms, **brief, "timing": timing, "error": data if code != 200 else None}
    workers = timing.get("phases", {}).get("workers")
    if code == 200 and workers and data.get("bytes_copied"):
        out["gbps_workers"] = data["bytes_copied"] / max(1, len(data.get("workers") or [1])) / workers / 1e9
    log(rid, "swap", code, {k: out.get(k) for k in ("bytes_copied", "client_ms", "gbps_workers")})
    return out


def status(srv: Server) -> dict:
    return httpx.get(srv.url + "/reap/status", timeout=60).json()


def misses(srv: Server, rid: str) -> dict:
    r = httpx.get(srv.url + f"/router_misses/{rid}", timeout=60).json()
    return {
        "totals": r.get("totals"),
        "workers": r.get("workers"),
        "tp_disagreement": r.get("tp_disagreement"),
        "layers": {
            k: {kk: v.get(kk) for kk in ("observed_selections", "missed_selections", "miss_ratio")}
            for k, v in (r.get("layers") or {}).items()
        },
    }


def collective_rpc(srv: Server, method: str, args=(), timeout=300) -> dict:
    code, data, ms = post(srv, "/collective_rpc", {"method": method, "args": list(args)}, timeout=timeout)
    return {"status": code, "result": data, "ms": ms}


REFERENCE: list[dict] | None = None  # stock-gpu's greedy outputs, when this call measured them
PROBE = False  # --moe-probe
PROBE_EXTENSION = ["--worker-extension-cls", "reap_swap.engine.moe_probe.MoeProbeExtension"]


def moe_probe(srv: Server, label: str) -> dict | None:
    """Every rank's MoE-block output digests (reap_moe_probe), when --moe-probe is on."""
    global PROBE
    if not PROBE:
        return None
    try:
        rpc = collective_rpc(srv, "reap_moe_probe", timeout=120)
    except httpx.HTTPError as exc:  # a hung collective would hang every later probe too: stop probing
        PROBE = False
        log(label, "moe probe failed; no more probes this call:", repr(exc))
        return {"status": None, "ranks": None, "error": repr(exc)}
    ranks = rpc["result"].get("results") if rpc["status"] == 200 else None
    errors = [r.get("error") for r in ranks or [] if r.get("error")]
    log(label, "moe probe", rpc["status"], f"{rpc['ms']:.0f} ms", "errors", errors or None)
    return {
        "status": rpc["status"],
        "ms": rpc["ms"],
        "ranks": ranks,
        "error": None if ranks else rpc["result"],
    }


def measure(srv: Server, rid: str | None, d1=(256, 3), d8=(128, 3)) -> dict:
    """Greedy text (compared with stock-gpu's when this call has it), then decode speed; for a
    reap-swap server (`rid` given) also the router misses of request `rid` (opened by the caller)."""
    label = rid or srv.name
    entry = {"greedy": greedy(srv.url)}
    if REFERENCE:
        c = compare(REFERENCE, entry["greedy"])
        log(
            label,
            "greedy vs stock-gpu:",
            c["identical"],
            "/",
            c["of"],
            "first divergence",
            c["first_divergence"],
        )
    if d1:
        entry["decode_1"] = decode_speed(srv.url, 1, n=d1[0], repeats=d1[1])
    if d8:
        entry["decode_8"] = decode_speed(srv.url, 8, n=d8[0], repeats=d8[1])
    if rid is not None:
        entry["router_misses"] = misses(srv, rid)
    log(
        label,
        "decode",
        entry.get("decode_1"),
        entry.get("decode_8"),
        "misses",
        (entry.get("router_misses") or {}).get("totals"),
    )
    return entry


def open_request(srv: Server, rid: str) -> None:
    """Open `rid` for statistics without changing the resident set (empty active set = core)."""
    post(
        srv,
        "/warm_active_set",
        {"request_id": rid, "phase": "prefill", "active_set": {}, "reset_router_stats": True},
    )


# ----------------------------------------------------------------------------- arms


def arm_stock(argv, name, out, uva_gib, res, d1=(256, 3), d8=(128, 3)):
    extra = (
        []
        if uva_gib is None
        else [
            "--offload-backend",
            "uva",
            "--cpu-offload-gb",
            f"{uva_gib:.3f}",
            "--cpu-offload-params",
            "w13_weight",
            "w2_weight",
        ]
    )
    global REFERENCE
    extra += PROBE_EXTENSION if PROBE else []
    with Server(name, argv + extra, out, env=DEV if PROBE else None, port=serving.free_port()) as srv:
        res[name] = {"startup_s": srv.startup_s, "argv": srv.command, **measure(srv, None, d1, d8)}
        res[name]["moe_probe"] = moe_probe(srv, name)
    if name == "stock-gpu":
        REFERENCE = res[name]["greedy"]


def swap_series(srv: Server, shape: dict, r: dict, save) -> None:
    """Swap speed: from nothing resident to 1 %, 10 %, 1 GiB and 100 % of the experts and back,
    3 times each (plus a no-op swap of the 1 % set); results under r["swaps"]."""
    total = shape["layers"] * shape["experts"]
    for label, n in (
        ("1pct", max(1, total // 100)),
        ("10pct", total // 10),
        ("1GiB", -(-(2**30) // shape["per_expert"])),
        ("100pct", total),
    ):
        aset = spread_experts(shape, n)
        runs = []
        for i in range(3):
            up = swap(srv, f"s-{label}-{i}", aset)
            noop = swap(srv, f"s-{label}-{i}-noop", aset) if label == "1pct" else None
            down = swap(srv, f"s-{label}-{i}-down", {})
            runs.append({"in": up, "noop": noop, "out": down})
        r["swaps"][label] = {"experts": n, "runs": runs}
        save()


def arm_sweep(reap, out, shape, res, save):
    plan_path = out / "plan-reap-sweep.json"
    make_plan(Path(reap[3]), 0.0, 8, plan_path)
    r = res.setdefault("reap-sweep", {"phases": {}, "swaps": {}})
    with Server(
        "reap-sweep", reap + ["--reap-plan", str(plan_path)], out, env=DEV, port=serving.free_port()
    ) as srv:
        r["startup_s"], r["argv"] = srv.startup_s, srv.command
        r["status_start"] = status(srv)
        open_request(srv, "p000")
        r["phases"]["0"] = measure(srv, "p000", d8=(64, 3))
        save()
        for pct in (25, 50, 100):
            k = shape["experts"] * pct // 100
            rid = f"p{pct:03d}"
            sw = swap(srv, rid, first_experts(shape, k))
            r["phases"][str(pct)] = {"swap": sw, **measure(srv, rid, d8=(64 if pct < 50 else 128, 3))}
            if pct == 25:
                r["selfcheck_25"] = collective_rpc(srv, "reap_selfcheck")
            save()
        sw = swap(srv, "p000b", {})
        r["phases"]["0b"] = {"swap": sw, **measure(srv, "p000b", d1=None, d8=None)}
        r["status_end_phases"] = status(srv)
        save()
        swap_series(srv, shape, r, save)
        r["status_end"] = status(srv)


def arm_clean(reap, out, shape, res, save):
    """The timing-critical subset of reap-sweep (100, 50, 0 % resident) and the swap series."""
    plan_path = out / "plan-reap-clean.json"
    make_plan(Path(reap[3]), 0.0, 8, plan_path)
    r = res.setdefault("reap-clean", {"phases": {}, "swaps": {}})
    with Server(
        "reap-clean", reap + ["--reap-plan", str(plan_path)], out, env=DEV, port=serving.free_port()
    ) as srv:
        r["startup_s"], r["argv"] = srv.startup_s, srv.command
        for pct, d1, d8 in ((100, (256, 3), (128, 3)), (50, (256, 3), (64, 2)), (0, (128, 2), (32, 2))):
            rid = f"c{pct:03d}"
            aset = first_experts(shape, shape["experts"] * pct // 100) if pct else {}
            sw = swap(srv, rid, aset)
            r["phases"][str(pct)] = {"swap": sw, **measure(srv, rid, d1=d1, d8=d8)}
            save()
        swap_series(srv, shape, r, save)
        r["status_end"] = status(srv)
        save()


def counter_check(srv: Server, layers: int, experts: int, keep: dict, n_requests=4, max_tokens=16) -> dict:
    """Our graph-mode counters vs vLLM's own per-token routed-experts output, request by request."""
    import numpy as np

    out = []
    for i in range(n_requests):
        rid = f"count-{i}"
        open_request(srv, rid)
        # a unique start: no prefix-cache block is shared with an earlier request, so every prompt
        # token is computed (and routed) by this request -- vLLM's routed_experts output also lists
        # the routing of prefix-cached tokens, which never reach an expert in this request
        r = httpx.post(
            srv.url + "/v1/completions",
            json={
                "model": "m",
                "prompt": f"[{time.time_ns()} check {i}] {PROMPTS[i]}",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
            timeout=120,
        )
        r.raise_for_status()
        arr = np.load(io.BytesIO(base64.b64decode(r.json()["choices"][0]["routed_experts"])))
        theirs = np.zeros((layers, experts), dtype=np.int64)
        for layer in range(arr.shape[1]):
            np.add.at(theirs[layer], arr[:, layer, :].ravel(), 1)
        ours = httpx.get(srv.url + f"/router_misses/{rid}", timeout=60).json()
        per_layer = []
        for layer in range(layers):
            row = ours["layers"][str(layer)]
            keep_l = set(keep[str(layer)])
            per_layer.append(
                {
                    "ours_counts": row.get("expert_counts"),
                    "theirs_counts": theirs[layer].tolist(),
                    "ours_missed": row.get("missed_selections"),
                    "theirs_missed": int(sum(c for e, c in enumerate(theirs[layer]) if e not in keep_l)),
                }
            )
        equal = all(
            p["ours_counts"] == p["theirs_counts"] and p["ours_missed"] == p["theirs_missed"]
            for p in per_layer
        )
        out.append(
            {
                "request": rid,
                "routed_experts_shape": list(arr.shape),
                "equal": equal,
                "workers": ours.get("workers"),
                "tp_disagreement": ours.get("tp_disagreement"),
                "ours_total": ours.get("totals"),
                "layers": per_layer,
            }
        )
        log("counter check", rid, "shape", list(arr.shape), "equal", equal)
    return {"requests": out, "all_equal": all(o["equal"] for o in out)}


def routed_server(name: str, reap: list[str], out: Path, budget_fraction: float) -> Server:
    """reap-swap with the plan core (25 %) filled at startup and vLLM's routed-experts output on."""
    plan_path = out / f"plan-{name}.json"
    make_plan(Path(reap[3]), 0.25, 8, plan_path, budget_fraction=budget_fraction)
    return Server(
        name,
        reap + ["--reap-plan", str(plan_path), "--enable-return-routed-experts"],
        out,
        env=DEV,
        port=serving.free_port(),
    )


def core_and_counters(srv: Server, shape: dict, r: dict, d1, n_requests: int) -> None:
    """Startup status, greedy text and decode with the core resident, then the counter check."""
    r["startup_s"], r["argv"] = srv.startup_s, srv.command
    r["status_start"] = st = status(srv)
    open_request(srv, "core")
    r["core"] = measure(srv, "core", d1=d1, d8=None)
    r["counter_check"] = counter_check(
        srv, shape["layers"], shape["experts"], st["layers"], n_requests=n_requests
    )


def arm_routed(reap, out, shape, res):
    r = res.setdefault("reap-routed", {})
    with routed_server("reap-routed", reap, out, 1.0) as srv:
        core_and_counters(srv, shape, r, (128, 1), 4)


@contextmanager
def plain_client_served(name, reap, out, r, cache_flags, d1=(256, 3), d8=(128, 2), core_fraction=0.25):
    """A server on the plan core 25 % (or `core_fraction`) / pool 50 % with `cache_flags`, its
    plain-client phase (no swap calls) measured into r["plain"]; yields the server for what an arm
    does next."""
    plan_path = out / f"plan-{name}.json"
    make_plan(Path(reap[3]), core_fraction, 8, plan_path, budget_fraction=0.5)
    argv = reap + ["--reap-plan", str(plan_path), *cache_flags]
    with Server(name, argv, out, env=DEV, port=serving.free_port()) as srv:
        r["startup_s"], r["argv"] = srv.startup_s, srv.command
        r["status_start"] = status(srv)
        open_request(srv, "plain")
        r["plain"] = measure(srv, "plain", d1=d1, d8=d8)
        r["plain"]["moe_probe"] = moe_probe(srv, f"{name} plain")
        yield srv


def arm_plain_client(name, reap, out, shape, res, cache_flags, d1=(256, 3), d8=(128, 2), core_fraction=0.25):
    """A plain OpenAI client on the plan core 25 % / pool 50 % (no swap calls): what the cache adds."""
    r = res.setdefault(name, {})
    with plain_client_served(name, reap, out, r, cache_flags, d1, d8, core_fraction) as srv:
        r["status_end"] = st = status(srv)
        log(name, "cache", json.dumps(st.get("cache"))[:1500])


def arm_cache_seeded(reap, out, shape, res, flags):
    """reap-cache-seeded: the plain client on the seeded device cache, then per-request swaps that
    pin inside the cache slots (device_cache_seeded.py), a too-wide one, and back to the core."""
    name = "reap-cache-seeded"
    r = res.setdefault(name, {})
    with plain_client_served(name, reap, out, r, flags) as srv:
        r["status_plain"] = status(srv).get("cache")
        r["seed"] = (r["status_plain"] or {}).get("seed")  # the form asked and served
        if (r["seed"] or {}).get("served") not in (None, "seeded"):
            log(name, "WARNING: the server did not serve seeded:", json.dumps(r["seed"]))
        q = shape["experts"] // 4  # the core is 0..q-1; the pool's per-layer share is 2q
        for rid, extra in (("s-half-tail", q // 2), ("s-full", q)):
            r[rid] = {"swap": swap(srv, rid, first_experts(shape, extra, start=q))}
            r[rid]["cache"] = status(srv).get("cache")
            r[rid]["measure"] = measure(srv, rid, d1=(128, 1), d8=None)
        first = f"layer_{shape['moe_layers'][0]}"
        wide = first_experts(shape, 0) | {first: list(range(q, 2 * q + 1))}  # 2q + 1 on one layer
        r["s-wide"] = swap(srv, "s-wide", wide)  # expected: refused, naming the layer
        r["s-core"] = {"swap": swap(srv, "s-core", {}), "cache": status(srv).get("cache")}
        r["s-core"]["measure"] = measure(srv, "s-core", d1=None, d8=None)
        r["status_end"] = status(srv)
        log(name, "cache", json.dumps(r["status_end"].get("cache"))[:1500])


def arm_tp(reap, out, shape, res, save):
    r = res.setdefault("reap-tp", {})
    with routed_server("reap-tp", reap, out, 0.5) as srv:
        core_and_counters(srv, shape, r, (128, 2), 2)
        r["core"]["moe_probe"] = moe_probe(srv, "reap-tp core")
        save()
        quarter = shape["experts"] // 4
        half = first_experts(shape, quarter, start=quarter)  # core 0..31 + 32..63 = 50 %
        other_half = first_experts(shape, quarter, start=2 * quarter)  # core + 64..95: 32 admissions/layer
        r["swap_50"] = swap(srv, "p050", half)
        r["status_50"] = status(srv)
        r["at_50"] = measure(srv, "p050", d1=(256, 3), d8=(128, 3))
        r["at_50"]["moe_probe"] = moe_probe(srv, "reap-tp 50 %")
        save()
        # a failure injected on rank 1, mid-swap (after one admission): both ranks must stay at 50 %
        r["fault_arm"] = collective_rpc(srv, "reap_arm_swap_fault", [1])
        r["fault_swap"] = swap(srv, "fault", other_half)
        r["status_after_fault"] = status(srv)
        r["after_fault"] = measure(srv, "p050", d1=None, d8=None)
        r["after_fault"]["moe_probe"] = moe_probe(srv, "reap-tp after fault")
        r["swap_back_25"] = swap(srv, "p025", {})
        r["status_25"] = status(srv)
        r["at_25"] = measure(srv, "p025", d1=None, d8=None)
        r["at_25"]["moe_probe"] = moe_probe(srv, "reap-tp 25 %")
        timings = []
        for i in range(3):
            timings.append({"in": swap(srv, f"t50-{i}", half), "out": swap(srv, f"t25-{i}", {})})
        r["swap_timings_25_50"] = timings
        r["status_end"] = status(srv)


def cache_flags(shadow: str, *extra: str) -> list[str]:
    """The reap-cache arms' server flags: the device cache (lfu, auto slots), ``extra``, and the
    debug shadow unless ``shadow`` is off."""
    flags = ["--reap-cache", "lfu", "--reap-cache-device", "on", "--reap-cache-slots", "auto", *extra]
    return flags + (["--reap-cache-shadow", shadow] if shadow != "off" else [])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/model")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--arms", default="stock-gpu,reap-sweep")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1, help="--pipeline-parallel-size for every arm")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument(
        "--common",
        help="replace the engine arguments every arm gets (a shell-quoted string; "
        "e.g. to smoke-test this driver on vLLM's CPU build)",
    )
    ap.add_argument(
        "--quantization",
        help="vLLM --quantization for every arm (e.g. fp8: online FP8 of a bf16 checkpoint, issue 16)",
    )
    ap.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="--no-enable-prefix-caching for every arm: the brief's condition for text equality (run 25 ran with it on)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny decode measurements (smoke tests)")
    ap.add_argument("--moe-probe", action="store_true", help="record bitwise MoE-layer output digests")
    ap.add_argument(
        "--cache-shadow",
        choices=["off", "out", "bytes"],
        default="off",
        help="reap-cache and reap-cache-seeded arms: --reap-cache-shadow (debug: every cached MoE step beside the uncached one)",
    )
    args = ap.parse_args()
    global QUICK, PROBE
    QUICK, PROBE = args.quick, args.moe_probe
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model)
    results_path = out / "gpu_e2e.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}

    def save():
        results_path.write_text(json.dumps(results, indent=1))

    global REFERENCE
    REFERENCE = (results.get("stock-gpu") or {}).get("greedy")
    shape = model_shape(model)
    base = shlex.split(args.common) if args.common else COMMON
    common = (
        base
        + (["--enforce-eager"] if args.eager else [])
        + (["--tensor-parallel-size", str(args.tp)] if args.tp > 1 else [])
        + (["--pipeline-parallel-size", str(args.pp)] if args.pp > 1 else [])
        + (["--quantization", args.quantization] if args.quantization else [])
        + (["--no-enable-prefix-caching"] if args.no_prefix_caching else [])
    )
    vllm = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)] + common
    reap = [sys.executable, "-m", "reap_swap.server", str(model)] + common
    results.setdefault("_meta", {})[f"{args.arms}@tp{args.tp}" + (f"pp{args.pp}" if args.pp > 1 else "")] = {
        "model": str(model),
        "shape": shape,
        "common": common,
        "started": time.ctime(),
    }
    for arm in args.arms.split(","):
        log("arm", arm)
        t0 = time.time()
        try:
            if arm == "stock-gpu":
                arm_stock(vllm, arm, out, None, results)
            elif arm == "stock-uva-all":  # what the launcher sets: every expert in pinned host memory
                arm_stock(vllm, arm, out, shape["expert_gib"] + 0.5, results, d1=(128, 1), d8=None)
            elif arm == "stock-uva-half":
                arm_stock(vllm, arm, out, shape["expert_gib"] / 2 / args.tp / args.pp, results)
            elif arm == "reap-sweep":
                arm_sweep(reap, out, shape, results, save)
            elif arm == "reap-clean":
                arm_clean(reap, out, shape, results, save)
            elif arm == "reap-routed":
                arm_routed(reap, out, shape, results)
            elif arm == "reap-cache":
                arm_plain_client(arm, reap, out, shape, results, cache_flags(args.cache_shadow))
            elif arm == "reap-cache-nocore":  # the pinned form with nothing pinned (cachetail, seedfix)
                flags = cache_flags(args.cache_shadow)
                arm_plain_client(arm, reap, out, shape, results, flags, core_fraction=0.0)
            elif arm == "reap-cache-seeded":  # served on CUDA since run 23
                flags = cache_flags(args.cache_shadow, "--reap-cache-seed", "seeded")
                arm_cache_seeded(reap, out, shape, results, flags)
            elif arm == "reap-plan25":
                arm_plain_client(arm, reap, out, shape, results, ["--reap-cache", "off"])
            elif arm == "reap-tp":
                arm_tp(reap, out, shape, results, save)
            else:
                raise ValueError(f"unknown arm {arm}")
        except Exception as exc:  # keep going with the next arm
            log(arm, "FAILED", repr(exc)[:3000])
            results.setdefault(arm, {})["error"] = repr(exc)[:5000]
        results.setdefault(arm, {})["wall_s"] = time.time() - t0
        save()
    save()


if __name__ == "__main__":
    serving.stop_servers_on_sigterm()
    main()
