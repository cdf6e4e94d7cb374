#!/usr/bin/env python3
"""Routing traces of the skewed model recorded by vLLM itself (issue 17), for `reap-swap simulate`.

One stock vLLM server (the bench's engine args, prefix caching off, --enable-return-routed-experts),
then per split the first --max-prompts records (reap_swap.bench.config.load_prompts, as the bench
reads them: the held-out split's first 8 are the bench's 8 prompts) sent one at a time as greedy
chat completions of --max-tokens tokens; each choice's routed_experts becomes one request of the
trace (reap_swap/cache/trace_served.py). Writes OUT/skew-<split>.npz (reap_swap/cache/trace.py format),
OUT/trace.json (per request: usage, routed shape, greedy tokens/text; server argv, startup) and
OUT/logs/. Exit 0 when every split's trace was written.

  python research/gpu/gpu_skew_trace.py --model /tmp/skew --out DIR [--measure-lock F] -- ENGINE ARGS

Replay: reap-swap simulate --trace OUT/skew-heldout.npz --plan PLAN --budget 0.25 0.5
        --prior-trace OUT/skew-calibration.npz --json sim.json --plot sim.png
Only the request loop needs a server; nothing here has run on a GPU yet (CPU: tests/test_skewbench.py
checks the trace building on synthetic responses).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from reap_swap.bench import server_driver as serving  # noqa: E402
from reap_swap.bench.config import load_prompts  # noqa: E402
from reap_swap.bench.env import MeasureLock  # noqa: E402
from reap_swap.cache.trace import save_trace  # noqa: E402
from reap_swap.cache.trace_served import trace_from_served  # noqa: E402
from reap_swap.compat.serve import STOCK_SERVER_MODULE  # noqa: E402
from reap_swap.sizing.model_shape import read_model_shape  # noqa: E402

SPLITS = {"heldout": "data/corpus/heldout.jsonl", "calibration": "data/corpus/calibration.jsonl"}


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--splits", default="heldout,calibration", help="comma-separated of " + ",".join(SPLITS))
    ap.add_argument("--max-prompts", type=int, default=32)
    ap.add_argument("--prompt-chars", type=int, default=2000, help="as reap-swap bench (default 2000)")
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy tokens per request (bench: 32)")
    ap.add_argument("--measure-lock", type=Path, help="flock taken once the server is up (bench_env)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("engine_args", nargs=argparse.REMAINDER, help="vLLM engine args, after --")
    a = ap.parse_args(argv)
    a.engine_args = a.engine_args[1:] if a.engine_args[:1] == ["--"] else a.engine_args
    return a


def server_argv(model: str, engine: list[str]) -> list[str]:
    argv = [sys.executable, "-m", STOCK_SERVER_MODULE, "--model", model, *engine]
    if not any(x == "--host" or x.startswith("--host=") for x in engine):
        argv += ["--host", "127.0.0.1"]
    return argv + ["--no-enable-prefix-caching", "--enable-return-routed-experts"]


def one_request(url: str, model_id: str, prompt: dict, max_tokens: int) -> dict:
    body = {
        "model": model_id,
        "messages": prompt["messages"],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "logprobs": True,
    }
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    doc = r.json()
    usage = doc.get("usage") or {}
    return {
        "tag": prompt.get("tag") or "",
        "index": prompt["index"],
        "line": prompt.get("line"),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "routed_experts": doc["choices"][0].get("routed_experts"),
        "greedy": serving.chat_greedy_record(doc),
    }


def record_split(url: str, model_id: str, a: argparse.Namespace, split: str, shape, out: dict) -> None:
    prompts = load_prompts(ROOT / SPLITS[split], a.max_prompts, a.prompt_chars)
    t0 = time.time()
    records = [one_request(url, model_id, p, a.max_tokens) for p in prompts]
    trace = trace_from_served(
        records,
        moe_layers=list(shape.moe_layers),
        model=str(a.model),
        num_experts=shape.num_experts,
        top_k=shape.top_k,
        per_expert_bytes=shape.expert_bytes,
        source={
            "recorder": "vLLM routed_experts (--enable-return-routed-experts), research/gpu/gpu_skew_trace.py",
            "split": SPLITS[split],
            "max_prompts": a.max_prompts,
            "prompt_chars": a.prompt_chars,
            "max_tokens": a.max_tokens,
            "one_request_at_a_time": True,
            "prefix_caching": False,
        },
    )
    path = a.out / f"skew-{split}.npz"
    save_trace(path, trace)
    out["splits"][split] = {
        "trace": str(path),
        "seconds": round(time.time() - t0, 2),
        "requests": trace.num_requests,
        "steps": trace.num_steps,
        "tokens": trace.num_tokens,
        "per_request": [{k: v for k, v in r.items() if k != "routed_experts"} for r in records],
    }
    print(f"wrote {path}: {trace.num_requests} requests, {trace.num_steps} steps", flush=True)


def main(argv=None) -> int:
    a = parse(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    shape = read_model_shape(a.model)
    out: dict = {"argv": sys.argv, "splits": {}}
    srv = serving.Server(
        "trace",
        server_argv(a.model, a.engine_args),
        a.out / "logs",
        port=serving.free_port(),
        startup_timeout_s=a.startup_timeout,
    )
    lock = MeasureLock(a.measure_lock)
    status = 1
    try:
        with srv:
            out["server"] = {"command": srv.command, "startup_s": srv.startup_s}
            out["measure_lock_wait_s"] = lock.acquire()
            model_id = httpx.get(srv.url + "/v1/models", timeout=60).json()["data"][0]["id"]
            for split in [s.strip() for s in a.splits.split(",") if s.strip()]:
                record_split(srv.url, model_id, a, split, shape, out)
            status = 0
    except Exception as exc:  # noqa: BLE001 - recorded in trace.json with what was written
        out["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        print(f"FAILED: {out['error']}", file=sys.stderr)
    finally:
        lock.release()
        (a.out / "trace.json").write_text(json.dumps(out, indent=1, default=str))
    return status


if __name__ == "__main__":
    serving.stop_servers_on_sigterm()
    sys.exit(main())
