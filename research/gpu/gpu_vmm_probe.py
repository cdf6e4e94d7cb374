#!/usr/bin/env python3
"""Where a 1 GiB swap's driver time goes (issue 17's swap guard), on one GPU, no vLLM.

Run 23 left the guard short in two of five sessions because the remaps and the publish (~17-18 ms for
103 units of 10 MiB) outlasted the copies. This measures what would make them cheaper:
  remap      per-unit cuMemUnmap and cuMemMap times (host -> device handle) and one cuMemSetAccess
  unmap_run  one cuMemUnmap over a run of N separately mapped units: accepted, and is it cheaper?
  threads    the same N remaps from 1, 2 and 4 threads (does the driver serialise them?)
  copy       N unit copies (host master -> HBM staging) alone vs with remaps of other units running
             (do the page-table updates slow the copy engine?)
Usage: python3 research/gpu/gpu_vmm_probe.py --out DIR [--units 103] [--repeats 5]  -> DIR/vmm_probe.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from reap_swap.engine import vmm  # noqa: E402
from reap_swap.engine.vmm import _access_desc, _check, _drv, _prop  # noqa: E402

UNIT = 10 * 2**20  # a Qwen3-30B-A3B expert (9 MiB) at 2 MiB granularity


def _handles(location: str, n: int) -> list:
    prop = _prop(location, 0)
    return [_check(_drv.cuMemCreate(UNIT, prop, 0)) for _ in range(n)]


def _reserve(n: int) -> int:
    return int(_check(_drv.cuMemAddressReserve(n * UNIT, 0, 0, 0)))


def _map_all(base: int, handles: list) -> None:
    for u, h in enumerate(handles):
        _check(_drv.cuMemMap(base + u * UNIT, UNIT, 0, h, 0))
    _check(_drv.cuMemSetAccess(base, len(handles) * UNIT, [_access_desc(0)], 1))


def _remap(base: int, units, handles, times=None) -> None:
    for u in units:
        t0 = time.perf_counter()
        _check(_drv.cuMemUnmap(base + u * UNIT, UNIT))
        t1 = time.perf_counter()
        _check(_drv.cuMemMap(base + u * UNIT, UNIT, 0, handles[u], 0))
        if times is not None:
            times["unmap"].append(t1 - t0)
            times["map"].append(time.perf_counter() - t1)


def _set_access(base: int, n: int) -> float:
    t = time.perf_counter()
    _check(_drv.cuMemSetAccess(base, n * UNIT, [_access_desc(0)], 1))
    return time.perf_counter() - t


def _ms(xs) -> float:
    return round(statistics.median(xs) * 1e3, 4)


def probe(n: int, repeats: int) -> dict:
    vmm.ensure_available(0)
    host, dev = _handles("host", n), _handles("device", n)
    base = _reserve(n)
    _map_all(base, host)
    out: dict = {"units": n, "unit_bytes": UNIT}
    # remap: host -> device and back, per-unit times, one publish each way
    rows = []
    for _ in range(repeats):
        times = {"unmap": [], "map": []}
        t = time.perf_counter()
        _remap(base, range(n), dev, times)
        access = _set_access(base, n)
        total = time.perf_counter() - t
        _remap(base, range(n), host)
        _set_access(base, n)
        rows.append({"total_ms": total * 1e3, "unmap_us": _ms(times["unmap"]) * 1e3,
                     "map_us": _ms(times["map"]) * 1e3, "access_ms": access * 1e3})  # fmt: skip
    out["remap"] = rows
    # unmap_run: one call over all n units, each mapped on its own
    try:
        t = time.perf_counter()
        _check(_drv.cuMemUnmap(base, n * UNIT))
        out["unmap_run"] = {"accepted": True, "ms": (time.perf_counter() - t) * 1e3}
        _map_all(base, host)
    except RuntimeError as exc:
        out["unmap_run"] = {"accepted": False, "error": str(exc)}
    # threads: the same remaps split over k threads, of accessible mappings as in a swap (run 24's
    # version unmapped mappings without access, ~5 us each instead of ~70: not what a swap pays)
    out["threads"] = {}
    for k in (1, 2, 4):
        walls = []
        for _ in range(repeats):
            _set_access(base, n)
            parts = [range(i, n, k) for i in range(k)]
            ts = [threading.Thread(target=_remap, args=(base, p, dev)) for p in parts]
            t = time.perf_counter()
            for th in ts:
                th.start()
            for th in ts:
                th.join()
            walls.append(time.perf_counter() - t)
            _remap(base, range(n), host)
        _set_access(base, n)
        out["threads"][k] = {"remap_ms": _ms(walls)}
    # copy: n unit copies from a second mapping of host masters into HBM staging, alone and while
    # another range's n units are remapped on the CPU
    src_handles = _handles("host", n)
    src = _reserve(n)
    _map_all(src, src_handles)
    staging = torch.empty(n * UNIT, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    rows = []
    for rep in range(repeats * 2):
        busy = rep % 2 == 1
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        for u in range(n):
            vmm.copy_async(staging.data_ptr() + u * UNIT, src + u * UNIT, UNIT, stream.cuda_stream)
        end.record(stream)
        remap_ms = None
        if busy:
            t = time.perf_counter()
            _remap(base, range(n), dev)
            _set_access(base, n)
            remap_ms = (time.perf_counter() - t) * 1e3
        end.synchronize()
        ms = start.elapsed_time(end)
        rows.append({"busy": busy, "copy_ms": ms, "gbps": n * UNIT / ms / 1e6, "remap_ms": remap_ms})
        if busy:
            _remap(base, range(n), host)
            _set_access(base, n)
    out["copy"] = {
        "alone_gbps": statistics.median(r["gbps"] for r in rows if not r["busy"]),
        "with_remaps_gbps": statistics.median(r["gbps"] for r in rows if r["busy"]),
        "rows": rows,
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--units", type=int, default=103)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **probe(args.units, args.repeats)}
    (out / "vmm_probe.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: v for k, v in doc.items() if k != "copy"}, indent=1))
    print("copy alone / with remaps GB/s:", doc["copy"]["alone_gbps"], doc["copy"]["with_remaps_gbps"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
