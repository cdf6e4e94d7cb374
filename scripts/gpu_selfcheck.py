#!/usr/bin/env python3
"""Start reap-swap on a GPU with a plan, run the engine self-check RPC, measure decode, stop.

Usage: python3 scripts/gpu_selfcheck.py --model /tmp/model --out DIR [extra server args]
(VLLM_SERVER_DEV_MODE=1 is set for the /collective_rpc route the self-check uses.)
"""

import argparse
import json
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_e2e import COMMON, Server, decode_speed, log, make_plan  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="/tmp/model")
ap.add_argument("--out", default=".")
ap.add_argument("--core-fraction", type=float, default=0.25)
args, extra = ap.parse_known_args()
out = Path(args.out)
plan_path = out / "plan-selfcheck.json"
make_plan(Path(args.model), args.core_fraction, 8, plan_path)
argv = [sys.executable, "-m", "reap_swap.server", args.model, *COMMON, "--reap-plan", str(plan_path), *extra]
result = {}
with Server("selfcheck", argv, out, env={"VLLM_SERVER_DEV_MODE": "1"}) as srv:
    r = httpx.post(srv.url + "/collective_rpc", json={"method": "reap_selfcheck"}, timeout=120)
    result["selfcheck"] = r.json()
    log("selfcheck", json.dumps(result["selfcheck"])[:3000])
    result["decode_1"] = decode_speed(srv.url, 1, repeats=1)
    log("decode", result["decode_1"])
(out / "selfcheck.json").write_text(json.dumps(result, indent=1))
