"""RAN ONCE, AGAINST A DESIGN SINCE REMOVED: compat/pinning.py at f5438dc (registration in 64 MiB pieces,
`PIECE_BYTES`, `block_releaser`); it no longer runs on main. Result (run 16, chunk_probe.json): a kernel and a
CUDA-graph replay read across pieces, but every memcpy spanning two registered pieces (the view into HBM, the
CPU tensor into HBM, blocking or not) fails with cudaErrorInvalidValue, and vLLM's weight loader copies with
memcpys; so main drains instead (drain_probe.py).

Exact pinning in pieces, with the project's own code (reap_swap/compat/pinning.py), before a server uses it.

A CPU copy registered as ~64 MiB page-cut pieces (cudaHostRegister each): does one CUDA view over the whole
copy read every piece (a kernel across piece boundaries, and a CUDA-graph replay), and does the engine-style
release (copy experts in ascending blocks, `block_releaser` unregisters and madvise(DONTNEED)s the pieces
copied) give the host memory back block by block while the copied bytes stay right?
GPU machine, from the repository root: PYTHONPATH=.:$PYTHONPATH python3 research-notes/pinned-round/chunk_probe.py
Prints one JSON line; exit 1 if a check fails.
"""

import json
import sys

import torch
from cuda.bindings import runtime as rt

from reap_swap.compat import pinning

MIB = 1 << 20


def rss_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return -1.0


def cuda_view(cpu: torch.Tensor) -> torch.Tensor:
    """What vLLM's view op does: the device pointer of the (registered) host memory, as a CUDA tensor."""
    err, dptr = rt.cudaHostGetDevicePointer(cpu.data_ptr(), 0)
    assert int(err) == 0, err

    class View:
        __cuda_array_interface__ = {
            "shape": tuple(cpu.shape), "typestr": "|u1", "data": (int(dptr), False), "version": 3,
        }  # fmt: skip

    return torch.as_tensor(View(), device="cuda")


def try_copy(f) -> str:
    try:
        f()
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the probe records what fails
        torch.cuda.synchronize()
        return f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def copy_variants(cpu: torch.Tensor, view: torch.Tensor, dst: torch.Tensor) -> dict:
    """Copies from the registered copy into HBM, each spanning piece boundaries except the first."""
    strided = torch.empty((4, 2 * slab_of(cpu)), dtype=torch.uint8, device="cuda")[:, : slab_of(cpu)]
    return {
        "within_one_piece": lambda: dst[0, : 32 * MIB].copy_(view[0, : 32 * MIB]),
        "contiguous_view_memcpy": lambda: dst[0:4].copy_(view[0:4]),
        "strided_dst_kernel": lambda: strided.copy_(view[0:4]),
        "from_cpu_tensor": lambda: dst[0:4].copy_(cpu[0:4]),
        "from_cpu_tensor_non_blocking": lambda: dst[0:4].copy_(cpu[0:4], non_blocking=True),
        "add_zero_kernel": lambda: torch.add(view[0:4], 0, out=dst[0:4]),
    }


def slab_of(cpu: torch.Tensor) -> int:
    return int(cpu.shape[1])


def blocks_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The engine's copy: a kernel (torch.add into the destination), never one memcpy over two pieces."""
    torch.add(src, 0, out=dst)


def main() -> int:
    torch.cuda.init()
    experts, slab = 26, 100 * MIB  # slabs of 100 MiB over pieces of 64 MiB: boundaries straddle
    out = {
        "torch": torch.__version__,
        "piece_mib": pinning.PIECE_BYTES // MIB,
        "rss0_mib": round(rss_mib()),
    }
    cpu = torch.empty((experts, slab), dtype=torch.uint8)
    for e in range(experts):
        cpu[e].fill_(e + 1)
    out["rss_filled_mib"] = round(rss_mib())
    view = pinning.exact_view(cuda_view)(cpu)
    copy = pinning._registered.get(cpu.data_ptr())
    out["pieces"] = 0 if copy is None else len(copy.pieces)
    out["registered_mib"] = pinning.registered_bytes() // MIB
    out["device_ptr_is_host_ptr"] = view.data_ptr() == cpu.data_ptr()
    sums = view[:, ::4096].sum(dim=1, dtype=torch.int64).cpu().tolist()
    out["kernel_reads_every_piece"] = sums == [(e + 1) * (slab // 4096) for e in range(experts)]
    idx = torch.arange(0, experts * slab, 63 * MIB + 4096, device="cuda")  # samples in many pieces
    flat = view.view(-1)
    static = torch.zeros((), dtype=torch.int64, device="cuda")
    graph, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        static.copy_(flat[idx].sum(dtype=torch.int64))
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        static.copy_(flat[idx].sum(dtype=torch.int64))
    cpu.view(-1)[idx[-1].item()] = 200  # a host write in the last piece, seen by the replay
    graph.replay()
    torch.cuda.synchronize()
    expect = sum((int(i) // slab) + 1 for i in idx.tolist()[:-1]) + 200
    out["graph_replay_reads_host"] = int(static.item()) == expect
    cpu.view(-1)[idx[-1].item()] = (int(idx[-1]) // slab) + 1
    # which copies may span two registered pieces? (run 16: a contiguous copy_ from the view raised
    # cudaErrorInvalidValue; the driver's memcpy looks the source up as one registration)
    dst = torch.empty((experts, slab), dtype=torch.uint8, device="cuda")
    out["copy_variants"] = {k: try_copy(f) for k, f in copy_variants(cpu, view, dst).items()}
    # the engine's re-home: ascending blocks of 5 experts into HBM, each followed by the block release
    release = pinning.block_releaser([view])
    rss, freed = [round(rss_mib())], 0
    for e0 in range(0, experts, 5):
        e1 = min(experts, e0 + 5)
        blocks_copy(dst[e0:e1], view[e0:e1])
        torch.cuda.synchronize()
        freed += release(e0, e1)
        rss.append(round(rss_mib()))
    out["rss_per_block_mib"] = rss
    out["released_in_blocks_mib"] = freed // MIB
    out["released_at_end_mib"] = pinning.release([cpu.data_ptr()]) // MIB
    sums = dst[:, ::4096].sum(dim=1, dtype=torch.int64).cpu().tolist()
    out["copied_bytes_right"] = sums == [(e + 1) * (slab // 4096) for e in range(experts)]
    out["rss_fell_by_mib"] = rss[0] - rss[-1]
    del view, flat, graph
    del cpu
    out["rss_after_free_mib"] = round(rss_mib())
    out["ok"] = (
        all(
            out[k]
            for k in (
                "device_ptr_is_host_ptr",
                "kernel_reads_every_piece",
                "graph_replay_reads_host",
                "copied_bytes_right",
            )
        )
        and out["pieces"] > 1
        and out["rss_fell_by_mib"] > 0.9 * experts * slab // MIB - 200
    )
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
