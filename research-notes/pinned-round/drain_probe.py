"""--reap-exact-pinning's re-home on the GPU with the project's own code, without vLLM.

Two [E, ...] expert tensors are pinned as the setting pins vLLM's UVA copies (compat/pinning.py `exact_view`:
one cudaHostRegister each, viewed on the device at the host pointer), read through the view by a
kernel and by a CUDA-graph replay, then re-homed by residency/engine.py `rehome` into a real host-backed
VMM range in blocks, with `pinning.drain` first (unregister whole, copy from the pageable CPU tensor)
and its `on_copied` after each block (madvise the copied pages away). Checks: the copied bytes, the
machine's memory in use never above the start by more than about a block while vLLM's copy shrinks and
the engine's units grow, and `release` at the end.
GPU machine, repository root: PYTHONPATH=.:$PYTHONPATH python3 research-notes/pinned-round/drain_probe.py
Prints one JSON line; exit 1 if a check fails.
"""

import json
import sys
import time

import torch
from cuda.bindings import runtime as rt
from reap_swap.residency import engine
from reap_swap.residency.unit_layout import plan_unit

from reap_swap.compat import pinning

MIB = 1 << 20


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return -1.0


def host_used_mib() -> float:
    """The machine's memory in use (MemTotal - MemAvailable): counts the engine's cuMemCreate host units too."""
    info = {line.split(":")[0]: int(line.split()[1]) for line in open("/proc/meminfo")}
    return (info["MemTotal"] - info["MemAvailable"]) / 1024


def cuda_view(cpu: torch.Tensor) -> torch.Tensor:
    """What vLLM's view op does: the device pointer of the (registered) host memory, as a CUDA tensor."""
    err, dptr = rt.cudaHostGetDevicePointer(cpu.data_ptr(), 0)
    assert int(err) == 0, err

    class View:
        __cuda_array_interface__ = {
            "shape": tuple(cpu.shape), "typestr": "|u1", "data": (int(dptr), False), "version": 3,
        }  # fmt: skip

    return torch.as_tensor(View(), device="cuda")


def per_expert_sums(t: torch.Tensor) -> list[int]:
    return t[:, ::4096].sum(dim=1, dtype=torch.int64).cpu().tolist()


def main() -> int:
    torch.cuda.init()
    experts, w13_slab, w2_slab = 40, 56 * MIB, 28 * MIB  # the V3 expert's bf16 bytes, as uint8
    out: dict = {"torch": torch.__version__, "block_mib": engine.RELEASE_BLOCK_BYTES // MIB}
    cpu = {"w13_weight": torch.empty((experts, w13_slab), dtype=torch.uint8)}
    cpu["w2_weight"] = torch.empty((experts, w2_slab), dtype=torch.uint8)
    for k, t in enumerate(cpu.values()):
        for e in range(experts):
            t[e].fill_((e + 1 + 50 * k) % 251)
    want = {
        n: [((e + 1 + 50 * k) % 251) * (t.shape[1] // 4096) for e in range(experts)]
        for k, (n, t) in enumerate(cpu.items())
    }
    out["rss_filled_mib"] = round(rss_mib())
    views = {n: pinning.exact_view(cuda_view)(t) for n, t in cpu.items()}
    out["registered_mib"] = pinning.registered_bytes() // MIB
    out["device_ptr_is_host_ptr"] = all(views[n].data_ptr() == cpu[n].data_ptr() for n in cpu)
    out["kernel_reads_view"] = all(per_expert_sums(views[n]) == want[n] for n in cpu)
    flat = views["w13_weight"].view(-1)
    idx = torch.arange(0, flat.numel(), 63 * MIB + 4096, device="cuda")
    static, graph, s = (
        torch.zeros((), dtype=torch.int64, device="cuda"),
        torch.cuda.CUDAGraph(),
        torch.cuda.Stream(),
    )
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        static.copy_(flat[idx].sum(dtype=torch.int64))
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        static.copy_(flat[idx].sum(dtype=torch.int64))
    last = int(idx[-1])
    keep = int(cpu["w13_weight"].view(-1)[last])
    cpu["w13_weight"].view(-1)[last] = 250  # a host write, seen by the replay
    graph.replay()
    torch.cuda.synchronize()
    expect = sum(int(cpu["w13_weight"].view(-1)[int(i)]) for i in idx.tolist())
    out["graph_replay_reads_host"] = int(static.item()) == expect
    cpu["w13_weight"].view(-1)[last] = keep
    ptrs = [v.data_ptr() for v in views.values()]
    layout = plan_unit([(n, t.shape[1]) for n, t in cpu.items()], granularity=2 * MIB, align=4096)
    t0 = time.perf_counter()  # the path without the setting's drain: one pass from the registered view
    whole, _, _ = engine.rehome(views, layout, 0)
    out["rehome_from_view_s"] = round(time.perf_counter() - t0, 2)
    whole.release()
    sources, on_copied = pinning.drain(views)
    out["sources_are_cpu"] = all(sources[n].device.type == "cpu" for n in cpu)
    rss, used, given = [round(rss_mib())], [round(host_used_mib())], []

    def record(e0: int, e1: int) -> int:
        given.append(on_copied(e0, e1))
        rss.append(round(rss_mib()))
        used.append(round(host_used_mib()))
        return given[-1]

    t0 = time.perf_counter()
    rng, _, homed = engine.rehome(sources, layout, 0, on_copied=record)
    out["rehome_s"] = round(time.perf_counter() - t0, 2)
    out["rehome_gbps"] = round(experts * (w13_slab + w2_slab) / out["rehome_s"] / 1e9, 1)
    out["blocks"] = len(given)
    out["rss_per_block_mib"] = rss
    out["host_used_per_block_mib"] = used  # vLLM's copy shrinks as the engine's units grow
    out["given_back_mib"] = sum(given) // MIB
    out["copied_bytes_right"] = all(per_expert_sums(homed[n]) == want[n] for n in cpu)
    out["released_mib"] = pinning.release(ptrs) // MIB
    out["rss_fell_by_mib"] = rss[0] - rss[-1]
    del views, flat, graph, sources, cpu
    out["rss_after_release_mib"] = round(rss_mib())
    out["registered_after_mib"] = pinning.registered_bytes() // MIB
    total = experts * (w13_slab + w2_slab) // MIB
    out["ok"] = bool(
        out["device_ptr_is_host_ptr"]
        and out["kernel_reads_view"]
        and out["graph_replay_reads_host"]
        and out["sources_are_cpu"]
        and out["copied_bytes_right"]
        and out["blocks"] > 1
        and out["given_back_mib"] > 0.95 * total
        and max(used) <= used[0] + engine.RELEASE_BLOCK_BYTES // MIB + 256
        and out["released_mib"] == total
        and out["registered_after_mib"] == 0
    )
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
