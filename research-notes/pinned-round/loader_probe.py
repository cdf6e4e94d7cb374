"""Does vLLM's weight loader work on a copy pinned by --reap-exact-pinning (one cudaHostRegister, viewed on the device)?

vLLM's MoE weight loader writes checkpoint shards into the parameter (the UVA view) with `copy_`: from a CPU tensor
(safetensors, pageable) or from a CUDA tensor, into a narrow slice of one expert. Run 16 found memcpys spanning two
registrations refused; this checks those copies into ONE registration, through the project's `exact_view`.
GPU machine, repository root: PYTHONPATH=.:$PYTHONPATH python3 research-notes/pinned-round/loader_probe.py
Prints one JSON line; exit 1 if a check fails.
"""

import json
import sys

import torch
from cuda.bindings import runtime as rt

from reap_swap.compat import pinning

MIB = 1 << 20


def cuda_view(cpu: torch.Tensor) -> torch.Tensor:
    err, dptr = rt.cudaHostGetDevicePointer(cpu.data_ptr(), 0)
    assert int(err) == 0, err

    class View:
        __cuda_array_interface__ = {
            "shape": tuple(cpu.shape), "typestr": "<f2", "data": (int(dptr), False), "version": 3,
        }  # fmt: skip

    return torch.as_tensor(View(), device="cuda").view(torch.bfloat16)


def attempt(f) -> str:
    try:
        f()
        torch.cuda.synchronize()
        return "ok"
    except Exception as e:  # noqa: BLE001 - the probe records what fails
        return f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"


def main() -> int:
    torch.cuda.init()
    experts, rows, cols = 8, 2 * 1024, 7168  # [w1; w3] of 1024 rows each x hidden 7168, bf16: 28 MiB a slab
    cpu = torch.zeros((experts, rows, cols), dtype=torch.bfloat16)
    view = pinning.exact_view(cuda_view)(cpu.view(torch.float16)).view(experts, rows, cols)
    out = {"torch": torch.__version__, "registered_mib": pinning.registered_bytes() // MIB}
    shard_cpu = torch.full((rows // 2, cols), 1.5, dtype=torch.bfloat16)  # w1 of expert 3, from safetensors
    shard_gpu = torch.full((rows // 2, cols), -2.0, dtype=torch.bfloat16, device="cuda")  # w3, already on GPU
    whole_cpu = torch.full((experts, rows, cols), 0.25, dtype=torch.bfloat16)
    out["h2d_pageable_into_slice"] = attempt(lambda: view[3].narrow(0, 0, rows // 2).copy_(shard_cpu))
    out["d2d_into_slice"] = attempt(lambda: view[3].narrow(0, rows // 2, rows // 2).copy_(shard_gpu))
    out["slices_right"] = bool(
        (cpu[3, : rows // 2] == 1.5).all() and (cpu[3, rows // 2 :] == -2.0).all() and (cpu[2] == 0).all()
    )
    out["h2d_whole_tensor"] = attempt(lambda: view.copy_(whole_cpu))
    out["whole_right"] = bool((cpu == 0.25).all())
    out["released_mib"] = pinning.release([cpu.data_ptr()]) // MIB
    keys = ("h2d_pageable_into_slice", "d2d_into_slice", "h2d_whole_tensor")
    out["ok"] = all(out[k] == "ok" for k in keys) and out["slices_right"] and out["whole_right"]
    print(json.dumps(out))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
