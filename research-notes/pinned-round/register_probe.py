"""Exact-size page-locking without PyTorch's caching host allocator (issue 15 item 4 follow-up).

torch 2.11 rounds every Tensor.pin_memory() up to a power of two and has no pinned_max_round_threshold_mb
(probe.py). Candidate: allocate an ordinary CPU tensor and page-lock it with cudaHostRegister. Checks RSS
growth, is_pinned(), a non_blocking H2D copy, and pinned_use_cuda_host_register's rounding. GPU machine:
  python3 register_probe.py"""

import json
import os
import subprocess
import sys

import torch
from probe import MIB, rss_mib  # same folder (run from here)


def registered(size_mib: int) -> dict:
    cudart = torch.cuda.cudart()
    before = rss_mib()
    t = torch.empty(size_mib * MIB, dtype=torch.uint8)
    rc = cudart.cudaHostRegister(t.data_ptr(), t.numel(), 0)
    after_reg = rss_mib()
    t.fill_(3)
    ok = None
    if int(rc) == 0:
        d = t.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        ok = bool((d[:: 1 << 20] == 3).all().item()) and int(d.sum(dtype=torch.int64).item()) == 3 * t.numel()
    out = {
        "req_mib": size_mib,
        "register_rc": int(rc),
        "is_pinned": t.is_pinned(),
        "rss_growth_at_register_mib": round(after_reg - before, 1),
        "rss_growth_mib": round(rss_mib() - before, 1),
        "h2d_copy_ok": ok,
    }
    out["unregister_rc"] = int(cudart.cudaHostUnregister(t.data_ptr())) if int(rc) == 0 else None
    del t
    return out


def pinned(size_mib: int) -> dict:
    before = rss_mib()
    t = torch.empty(size_mib * MIB, dtype=torch.uint8).pin_memory()
    return {"req_mib": size_mib, "rss_growth_mib": round(rss_mib() - before, 1), "is_pinned": t.is_pinned()}


if __name__ == "__main__":
    torch.cuda.init()
    if len(sys.argv) > 1:
        print(json.dumps({"conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), "pin_memory": pinned(2600)}))
        sys.exit()
    print(json.dumps({"torch": torch.__version__, "cudaHostRegister": [registered(m) for m in (600, 2600)]}))
    env = dict(
        os.environ, PYTORCH_CUDA_ALLOC_CONF="pinned_use_cuda_host_register:True,pinned_num_register_threads:8"
    )
    r = subprocess.run([sys.executable, __file__, "child"], env=env, capture_output=True, text=True)
    print(r.stdout.strip() or r.stderr[-600:])
