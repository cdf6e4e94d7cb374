"""The exact-pinning design end to end at the torch level, without vLLM (issue 15 item 4 follow-up).

vLLM's UVA offload makes a CUDA view of a pinned CPU tensor (cudaHostGetDevicePointer + from_blob). With
cudaHostRegister instead of pin_memory(): is the device pointer the host pointer, does a kernel read the
bytes through the view (also inside a CUDA graph), and does the host memory come back after unregister
and free? GPU machine: python3 view_probe.py"""

import json

import torch
from cuda.bindings import runtime as rt
from probe import MIB, rss_mib


def main() -> None:
    torch.cuda.init()
    n = 2600 * MIB
    out = {"torch": torch.__version__, "rss0_mib": round(rss_mib(), 1)}
    t = torch.empty(n, dtype=torch.uint8)
    t.fill_(5)
    out["rss_filled_mib"] = round(rss_mib(), 1)
    out["register_rc"] = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 3))  # portable | mapped
    err, dptr = rt.cudaHostGetDevicePointer(t.data_ptr(), 0)
    out["get_device_pointer"] = str(err)
    out["device_ptr_is_host_ptr"] = int(dptr) == t.data_ptr()
    out["rss_registered_mib"] = round(rss_mib(), 1)

    class View:
        __cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (int(dptr), False), "version": 3}

    g = torch.as_tensor(View(), device="cuda")
    out["view_sum_ok"] = int(g[::4096].sum(dtype=torch.int64).item()) == 5 * (n // 4096)
    t[:4096].fill_(7)  # a host write is seen by the device
    out["host_write_seen"] = int(g[0].item()) == 7
    idx = torch.arange(0, n, 1 << 20, device="cuda")
    static_out = torch.zeros((), dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        static_out.copy_(g[idx].sum(dtype=torch.int64))
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        static_out.copy_(g[idx].sum(dtype=torch.int64))
    t[1 << 20 : (1 << 20) + 1].fill_(9)
    graph.replay()
    torch.cuda.synchronize()
    expect = 7 + 9 + 5 * (len(idx) - 2)
    out["graph_replay_reads_host"] = int(static_out.item()) == expect
    del g, View
    torch.cuda.synchronize()
    out["unregister_rc"] = int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr()))
    del t
    out["rss_after_free_mib"] = round(rss_mib(), 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
