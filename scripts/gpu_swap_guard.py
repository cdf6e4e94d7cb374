#!/usr/bin/env python3
"""Issue 17's swap guard on one GPU: a 1 GiB swap >= 50 GB/s, with and without publishing access
in chunks while copies are in flight (swap.py), A/B in one process, arms interleaved per repeat.

The bench of research.md run 4 (scripts/gpu_swap_bench.py's bench_swaps): Qwen3-30B-A3B-shaped
layers (E=128, H=2048, I=768, bf16), 8 layers, a pool for every expert (1024 slots); each sample
evicts everything (no copy), then times swap-in of 10 % of the pool, a 1 GiB delta and 100 % of
the pool (bytes = the 9 MiB payload per expert). Arms: --publish-every values (0 = off, the run-4
path; 8 = the default). After the last repeat the chunked arm's 100 % swap is checked bitwise
against the original weights of layer 0 (the bytes really landed where the kernel reads).
Needs torch and cuda-python only (no vLLM). Runtime ~1-2 min on the H200 (setup pins ~10 GB).
Usage: python3 scripts/gpu_swap_guard.py --out DIR [--repeats 5] [--publish-every 0,8,32]
Writes DIR/swap_guard.json (raw samples + summary) and DIR/swap_guard.log.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, when not on PYTHONPATH
from reap_swap.guard_report import swap_summary  # noqa: E402
from reap_swap.residency.engine import standalone_state  # noqa: E402
from reap_swap.residency.swap import PUBLISH_EVERY, apply_swap  # noqa: E402

CANDIDATE = 8  # the chunk size the A/B checks against the 50 GB/s guard (swap.PUBLISH_EVERY, on since run 12)
from reap_swap.residency.vmm_store import VmmStore  # noqa: E402

E, H, I = 128, 2048, 768
log = logging.getLogger("swap_guard")


def _weights(gen):
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    return w13, w2


def _target(keys) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for l, e in keys:
        out.setdefault(l, []).append(e)
    return out


def run(num_layers: int, repeats: int, arms: list[int]) -> tuple[list[dict], dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    layers = {l: _weights(gen) for l in range(num_layers)}
    t0 = time.perf_counter()
    st, views = standalone_state(layers, num_slots=num_layers * E)
    setup = time.perf_counter() - t0
    ref = layers[0]  # kept on the device for the bitwise check; the others are freed
    del layers
    torch.cuda.empty_cache()
    unit = st.pool.unit_bytes
    keys = [(l, e) for l in range(num_layers) for e in range(E)]
    cases = {"10pct_pool": len(keys) // 10, "1GiB_delta": -(-(2**30) // unit), "100pct_pool": len(keys)}
    log.info("setup %.1fs: %d layers, unit %d B, cases %s, arms %s", setup, num_layers, unit, cases, arms)
    samples = []
    for case, n in cases.items():
        for rep in range(repeats + 1):  # rep 0: a warm-up per case, not recorded
            for arm in arms if rep % 2 else arms[::-1]:  # alternate the order between repeats
                apply_swap(st.table, VmmStore(st, 0), {})  # everything back on the host
                torch.cuda.synchronize()
                target = _target(keys[:n] if rep % 2 == 0 else keys[-n:])
                t = time.perf_counter()
                res = apply_swap(st.table, VmmStore(st, arm), target)
                dt = time.perf_counter() - t
                row = {"case": case, "arm": str(arm), "rep": rep, "experts": n, "bytes": res.bytes_copied,
                       "s": dt, "gbps": res.bytes_copied / dt / 1e9, "phases": res.phases}  # fmt: skip
                log.info("%s arm=%s rep=%d %.1f GB/s %s", case, arm, rep, row["gbps"],
                         {k: round(v * 1e3, 2) if k != "publish_chunks" else v for k, v in res.phases.items()})  # fmt: skip
                if rep:
                    samples.append(row)
    chunked = max(arms)
    apply_swap(st.table, VmmStore(st, 0), {})
    apply_swap(st.table, VmmStore(st, chunked), _target(keys))
    torch.cuda.synchronize()
    check = {"arm": chunked, "w13_equal": bool(torch.equal(views[0][0], ref[0])),
             "w2_equal": bool(torch.equal(views[0][1], ref[1]))}  # fmt: skip
    apply_swap(st.table, VmmStore(st, 0), {})
    for entry in st.layers.values():
        entry.rng.release()
    st.pool.release()
    return samples, {
        "setup_s": setup,
        "unit_bytes": unit,
        "layers": num_layers,
        "bitwise_after_chunked_100pct": check,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--publish-every", default=f"0,{CANDIDATE},32", help="arms: comma-separated, 0 = off")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(message)s",
        handlers=[logging.FileHandler(out / "swap_guard.log"), logging.StreamHandler()],
    )
    arms = [int(a) for a in args.publish_every.split(",")]
    samples, meta = run(args.layers, args.repeats, arms)
    summary = swap_summary(samples, default_arm=str(CANDIDATE), baseline_arm="0")
    doc = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "default_publish_every": PUBLISH_EVERY,
           "arms": arms, "repeats": args.repeats, **meta, "summary": summary, "samples": samples}  # fmt: skip
    (out / "swap_guard.json").write_text(json.dumps(doc, indent=1))
    for case, rows in summary["cases"].items():
        for arm, row in rows.items():
            g = row["gbps"]
            log.info("%-12s publish_every=%-3s %.1f GB/s (%.1f-%.1f), publish tail %.2f ms, overlapped %.2f ms",
                     case, arm, g["median"], g["min"], g["max"], row["publish_ms"]["median"],
                     row["publish_overlapped_ms"]["median"])  # fmt: skip
    log.info("guard: %s; bitwise: %s", summary["guard"], meta["bitwise_after_chunked_100pct"])
    ok = meta["bitwise_after_chunked_100pct"]
    return 0 if ok["w13_equal"] and ok["w2_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
