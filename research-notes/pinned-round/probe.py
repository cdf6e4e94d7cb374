"""Does this torch's pinned host allocator honour pinned_max_round_threshold_mb? (issue 15 item 4)

vLLM's UVA offloader pins each expert tensor with Tensor.pin_memory(), which PyTorch's caching host
allocator rounds up to a power of two: a 21 GiB layer tensor takes 32 GiB. Run on the GPU machine:
  python3 probe.py            # in-process setter, then env-var child processes
Prints one JSON line per case: requested MiB, RSS growth MiB, host_memory_stats allocated MiB."""

import json
import os
import subprocess
import sys

import torch

MIB = 1 << 20


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return -1.0


def one(size_mib: int) -> dict:
    before = rss_mib()
    t = torch.empty(size_mib * MIB, dtype=torch.uint8).pin_memory()
    t.fill_(1)
    stats = {}
    try:
        s = torch.cuda.host_memory_stats()
        stats = {k: s[k] / MIB for k in ("allocated_bytes.current", "reserved_bytes.current") if k in s}
    except Exception as exc:  # noqa: BLE001
        stats = {"error": repr(exc)[:200]}
    out = {"req_mib": size_mib, "rss_growth_mib": round(rss_mib() - before, 1), **stats}
    del t
    try:
        torch._C._host_emptyCache()
    except Exception:  # noqa: BLE001
        pass
    return out


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "parent"
    torch.cuda.init()
    info = {"torch": torch.__version__, "mode": mode, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if mode == "setter":
        fn = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        info["setter"] = fn is not None
        try:
            fn("pinned_max_round_threshold_mb:64") if fn else None
            info["set_ok"] = True
        except Exception as exc:  # noqa: BLE001
            info["set_ok"] = repr(exc)[:300]
        try:
            torch.cuda.memory._set_allocator_settings("pinned_max_round_threshold_mb:64")
            info["cuda_set_ok"] = True
        except Exception as exc:  # noqa: BLE001
            info["cuda_set_ok"] = repr(exc)[:300]
    if mode != "parent":
        info["cases"] = [one(m) for m in (80, 600, 2600)]
        print(json.dumps(info), flush=True)
        return
    for child_mode, conf in (
        ("plain", None),
        ("setter", None),
        ("env", "pinned_max_round_threshold_mb:64"),
        ("env", "pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:64"),
    ):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        r = subprocess.run([sys.executable, __file__, child_mode], env=env, capture_output=True, text=True)
        print(
            r.stdout.strip()
            or json.dumps({"mode": child_mode, "conf": conf, "rc": r.returncode, "stderr": r.stderr[-600:]}),
            flush=True,
        )


if __name__ == "__main__":
    main()
