#!/usr/bin/env python3
"""H200 lane for `--reap-budget auto | GiB` (issue 15 item 5): one model, four servers.

  python3 research/gpu/gpu_budget_auto.py --model /tmp/skew --plan OUT/skew.plan.json --out DIR

Arms (each one server, enforce-eager off, prefix caching off, one request at a time):
  auto@U                --reap-budget auto at --gpu-memory-utilization U (default 0.08 and 0.14:
                        on the 13.5 GiB-expert mk_model the first leaves a partial pool, the second all)
  cap@U                 --reap-budget <--cap-gib> at U
  refused               --reap-kv-tokens far beyond memory: the server must exit before serving
For each serving arm: the "reap-swap memory split" log line, GET /reap/status (memory_split and
the workers' budget), greedy text of 4 prompts compared with the reference arm's (--ref-arm), one /swap_active_set of
the plan's first cartridge-free slice per layer (bytes must move). Writes DIR/budget_auto.json.
Bounded: each server start <= --startup-s (300 s); about 4 GPU minutes for the mini/skewed model.

Hybrid attention (branch hybridkv): `--config tests/data/qwen3_5_moe_35b_a3b_config.json` writes that
config (no checkpoint) to DIR/model and serves it with --load-format dummy (and vLLM's Triton GDN
prefill); `--model` is then ignored. The KV target comes from vLLM's own KV grouping
(compat/kv_spec.py); the summary says whether vLLM allocated exactly those bytes (kv_agrees).
Full-size Qwen3.5 needs ~430 s to start: one arm per call, --startup-s 540.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from reap_swap.bench import server_driver as serving  # noqa: E402
from reap_swap.bench.server_driver import Server, ServerError, free_port, greedy_completions  # noqa: E402

PROMPTS = ["def fibonacci(n):", "The capital of France is", "Once upon a time", "SELECT * FROM"]
SPLIT = re.compile(r"reap-swap memory split: .*")


EXTRA: list[str] = []  # --extra / --config: appended to every arm's vLLM arguments


def serve_args(model: str, plan: str, util: float, budget: str, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "reap_swap.server", model, "--served-model-name", "m",
        "--reap-plan", plan, "--reap-budget", budget, "--gpu-memory-utilization", str(util),
        "--max-model-len", "2048", "--max-num-seqs", "8", "--no-enable-prefix-caching", *extra, *EXTRA,
    ]  # fmt: skip


def arm_argv(name: str, a: argparse.Namespace) -> list[str]:
    """auto@U: --reap-budget auto at utilization U; cap@U: --reap-budget --cap-gib at U;
    refused: auto at 0.5 with a KV target far beyond memory (the server must exit before serving)."""
    kind, _, util = name.partition("@")
    if kind == "refused":
        return serve_args(a.model, a.plan, 0.5, "auto", ["--reap-kv-tokens", str(2**31 - 1)])
    if kind not in ("auto", "cap") or not util:
        raise SystemExit(f"--arms: unknown arm {name!r} (auto@U, cap@U, refused)")
    return serve_args(a.model, a.plan, float(util), "auto" if kind == "auto" else a.cap_gib, [])


def one_slice_per_layer(plan_doc: dict, resident: dict | None = None) -> dict:
    """Per layer, the first slice with an expert the pool does not hold yet (so the swap must move
    bytes: run 10's first-slice swap moved none, the fill order had already made it resident);
    the last slice where every slice is resident (an `auto` pool holding all experts)."""
    out = {}
    for i, (k, layer) in enumerate(plan_doc["perLayer"].items()):
        slices = layer.get("sliceCatalog") or []
        if not slices:
            continue
        have = set((resident or {}).get(str(i), []))
        fresh = [s for s in slices if not set(s["experts"]) <= have]
        out[k] = [(fresh or slices[-1:])[0]["sliceId"]]
    return out


def run_arm(name: str, argv: list[str], out: Path, plan_doc: dict, startup_s: float = 300) -> dict:
    rec: dict = {"arm": name, "argv": argv}
    srv = Server(name, argv, out, port=free_port(), startup_timeout_s=startup_s)
    try:
        with srv:
            rec["startup_s"] = srv.startup_s
            rec["status"] = httpx.get(srv.url + "/reap/status", timeout=30).json()
            rec["greedy"] = greedy_completions(srv.url, PROMPTS, max_tokens=32)
            active = one_slice_per_layer(plan_doc, rec["status"].get("layers"))
            body = {"request_id": f"{name}-swap", "active_set": active}
            r = httpx.post(srv.url + "/swap_active_set", json=body, timeout=120)
            rec["swap"] = {"code": r.status_code, "body": r.json()}
            rec["status_after_swap"] = httpx.get(srv.url + "/reap/status", timeout=30).json()
            rec["greedy_after_swap"] = greedy_completions(srv.url, PROMPTS, max_tokens=32)
    except ServerError as exc:
        rec["server_error"] = str(exc)[-4000:]
    log = srv.log_path.read_text(errors="replace") if srv.log_path.exists() else ""
    rec["split_line"] = (SPLIT.findall(log) or [None])[-1]
    rec["refusal_lines"] = [l for l in log.splitlines() if "startup refused" in l or "BudgetError" in l][-5:]
    rec["tracebacks_in_log"] = log.count("Traceback (most recent call last)")
    return rec


def dummy_model(config: Path, dest: Path) -> Path:
    """config.json (+ a tokenizer) in dest; dummy weights and, for Gated DeltaNet, vLLM's Triton
    prefill (the kit has no flashinfer: run 8), as research/gpu/gpu_families.py serves it."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_families

    model = gpu_families.write_model(config, dest, None)
    EXTRA.extend(["--load-format", "dummy"])
    if (model / "preprocessor_config.json").exists():  # multimodal class kept (0.26.0): no image/video
        EXTRA.extend(["--limit-mm-per-prompt", json.dumps({"image": 0, "video": 0})])  # as gpu_families
    if gpu_families.uses_gated_deltanet(json.loads((model / "config.json").read_text())):
        EXTRA.extend(["--gdn-prefill-backend", "triton"])
    return model


def kv_summary(split: dict) -> dict:
    """The KV half of the split: computed bytes, what vLLM allocated, and its layout."""
    alloc = split.get("kv_allocated") or {}
    return {
        "kv_bytes": split.get("kv_bytes"), "kv_allocated_bytes": alloc.get("bytes"),
        "kv_agrees": split.get("kv_agrees"), "kv_layout": split.get("kv_layout", "config sum"),
        "vllm_one_request_bytes": split.get("vllm_one_request_bytes"), "kv_source": split.get("kv_source"),
    }  # fmt: skip


def _pool_kept_full(r: dict) -> bool | None:
    """After the swap the workers' pool is as full as before it (pool_fill.py), or holds all experts."""
    before, after = r.get("status") or {}, r.get("status_after_swap") or {}
    if not before.get("pool") or not after:
        return None
    return after["resident_experts"] >= min(before["resident_experts"], before["pool"]["slots"])


def dry_run(a: argparse.Namespace, out: Path) -> int:
    """What the arms would run (gpu_run.sh DRY=1): each server's command and the swap the lane would
    send with an empty pool; the plan may be missing (the budget phase makes it on the device)."""
    plan = Path(a.plan)
    plan_doc = json.loads(plan.read_text()) if plan.exists() else None
    doc = {
        "model": a.model, "plan": a.plan, "plan_found": plan_doc is not None,
        "arms": {name: arm_argv(name, a) for name in a.arms.split(",")},
        "swap_with_empty_pool": one_slice_per_layer(plan_doc) if plan_doc else None,
    }  # fmt: skip
    (out / "budget_auto.dry.json").write_text(json.dumps(doc, indent=2))
    print(json.dumps({k: doc[k] for k in ("model", "plan", "plan_found")}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="model folder (not needed with --config)")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--cap-gib", default="4")
    ap.add_argument("--arms", default="auto@0.08,auto@0.14,cap@0.14,refused")
    ap.add_argument("--ref-arm", default=None, help="greedy reference arm (default: the last auto@ arm)")
    ap.add_argument(
        "--config", type=Path, help="serve this config.json with --load-format dummy (hybrid lane)"
    )
    ap.add_argument("--extra", default="", help="more vLLM arguments for every arm (one shell-quoted string)")
    ap.add_argument("--startup-s", type=float, default=300.0)
    ap.add_argument("--dry-run", action="store_true", help="write DIR/budget_auto.dry.json; start no server")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    EXTRA.extend(shlex.split(a.extra))
    if a.config:
        a.model = str(dummy_model(a.config, out / "model"))
    elif not a.model:
        ap.error("--model or --config is required")
    if a.dry_run:
        return dry_run(a, out)
    plan_doc = json.loads(Path(a.plan).read_text())
    arms = {name: arm_argv(name, a) for name in a.arms.split(",")}
    results = {}
    for name in a.arms.split(","):
        results[name] = run_arm(name, arms[name], out, plan_doc, a.startup_s)
        (out / "budget_auto.json").write_text(json.dumps(results, indent=2, default=str))
        print(
            name, results[name].get("split_line") or results[name].get("server_error", "")[:300], flush=True
        )
    autos = [n for n in results if n.startswith("auto@")]
    ref_arm = a.ref_arm or (autos[-1] if autos else None)
    ref = results.get(ref_arm, {}).get("greedy") if ref_arm else None
    summary = {
        n: {
            "served": "greedy" in r,
            "text_same_as_ref": ref is not None and [g["text"] for g in r.get("greedy", [])] == [g["text"] for g in ref],
            "text_same_after_swap": [g["text"] for g in r.get("greedy", [])] == [g["text"] for g in r.get("greedy_after_swap", [])],
            "swap_bytes": (r.get("swap") or {}).get("body", {}).get("bytes_copied"),
            "pool_kept_full": _pool_kept_full(r),
            "split_line": r.get("split_line"),
            **kv_summary((r.get("status") or {}).get("memory_split") or {}),
        }
        for n, r in results.items()
    }  # fmt: skip
    refused = results.get("refused", {})
    summary["refused_ok"] = "refused" not in results or (
        "greedy" not in refused
        and any("startup refused" in l and "GiB" in l for l in refused["refusal_lines"])
    )
    (out / "budget_auto.summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return (
        0
        if summary["refused_ok"]
        and all(v["served"] for k, v in summary.items() if k not in ("refused", "refused_ok"))
        else 1
    )


if __name__ == "__main__":
    serving.stop_servers_on_sigterm()
    sys.exit(main())
