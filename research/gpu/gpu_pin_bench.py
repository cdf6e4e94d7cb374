#!/usr/bin/env python3
"""Why does reap-swap start slower than stock at real size? Time vLLM's UVA offload steps alone.

Run 8 (research.md): Qwen3.5-35B-A3B reached /health after 368 s with reap-swap against 183 s
stock; the server log puts 112 s between model construction and vLLM's "Total CPU offloaded
parameters: 60.0" line. That is vLLM's UVAOffloader (0.26.0, model_executor/offloader/uva.py):
per expert parameter `p.data.to("cpu")` (pageable), then `.pin_memory()` (PyTorch's caching host
allocator: cudaHostAlloc), then a UVA view (`get_accelerator_view_from_cpu_tensor`). This script
repeats exactly those three steps on --gib GiB of 1 GiB tensors, in one child process per pinned
allocator setting, and checks the UVA view reads and writes the pinned bytes:

  default        cudaHostAlloc (what run 8 used)
  register8      PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,
                 pinned_num_register_threads:8 (PyTorch's documented setting: malloc, pre-fault
                 the pages with 8 threads, then cudaHostRegister)

Writes OUT/pin_bench.json; prints one line per setting. `gpu_families.sh all` runs it first (about
20 s) and uses register8 for its reap-swap servers only when its UVA view check passed and it was
faster (so a failing setting costs no family). Nothing here is a serving measurement.
  python3 research/gpu/gpu_pin_bench.py --out DIR [--gib 4]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "default": None,
    "register8": "pinned_use_cuda_host_register:True,pinned_num_register_threads:8",
}
GIB = 2**30


def child(gib: int) -> dict:
    """In a fresh process (the allocator setting is read once): time the offloader's steps."""
    import torch
    import vllm._C_stable_libtorch  # noqa: F401 - registers torch.ops._C (0.26.0 platforms/cuda.py)

    def get_accelerator_view_from_cpu_tensor(cpu):  # vllm.utils.torch_utils' CUDA branch, 0.26.0
        return torch.ops._C.get_cuda_view_from_cpu_tensor(cpu)

    torch.manual_seed(0)
    t_cpu = t_pin = 0.0
    ok = True
    keep = []
    for _ in range(gib):
        x = torch.randn(GIB // 2, dtype=torch.bfloat16, device="cuda")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        c = x.to(device="cpu")
        t1 = time.perf_counter()
        c = c.pin_memory()
        t2 = time.perf_counter()
        view = get_accelerator_view_from_cpu_tensor(c)
        ok &= bool(torch.equal(view, x))  # the device reads the pinned bytes through UVA
        view.mul_(2)  # and writes them
        torch.cuda.synchronize()
        ok &= bool(torch.equal(c[:4096].to("cuda"), x[:4096] * 2))
        t_cpu, t_pin = t_cpu + t1 - t0, t_pin + t2 - t1
        keep.append(c)
        del x, view
    return {
        "gib": gib,
        "to_cpu_s": t_cpu,
        "pin_s": t_pin,
        "uva_view_ok": ok,
        "pinned": bool(keep[0].is_pinned()),
    }


def run_setting(name: str, conf: str | None, gib: int, timeout: float) -> dict:
    env = dict(os.environ)
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    else:
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    t0 = time.time()
    try:
        p = subprocess.run(
            [sys.executable, __file__, "--child", str(gib)],
            env=env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"setting": name, "conf": conf, "error": f"timeout after {timeout:.0f} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    out = json.loads(lines[-1]) if p.returncode == 0 and lines else {"error": p.stderr[-2000:]}
    out.update(setting=name, conf=conf, wall_s=time.time() - t0)
    if "pin_s" in out:
        out["gib_per_s"] = out["gib"] / max(1e-9, out["to_cpu_s"] + out["pin_s"])
    return out


def choose(results: list[dict]) -> str:
    """register8 only when its UVA view check passed and its offload steps were faster."""
    by = {r["setting"]: r for r in results}
    d, r = by.get("default", {}), by.get("register8", {})
    if r.get("uva_view_ok") and r.get("pinned") and r.get("gib_per_s", 0) > 1.1 * d.get("gib_per_s", 0):
        return "register8"
    return "default"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--gib", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child)))
        return 0
    results = [run_setting(n, c, a.gib, a.timeout) for n, c in SETTINGS.items()]
    doc = {"results": results, "chosen": choose(results), "chosen_conf": SETTINGS[choose(results)]}
    for r in results:
        print(
            json.dumps(
                {k: r.get(k) for k in ("setting", "to_cpu_s", "pin_s", "gib_per_s", "uva_view_ok", "error")}
            )
        )
    print("chosen", doc["chosen"])
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "pin_bench.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
