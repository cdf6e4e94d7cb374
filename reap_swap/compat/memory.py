"""vLLM's memory surface for `--reap-budget auto | GiB` (engine/residency/budget.py), per version.

Read in the vLLM 0.26.0 source (v1/worker/gpu_worker.py, v1/worker/gpu_model_runner.py,
config/cache.py, config/vllm.py); run on the H200 through research/gpu/gpu_budget_auto.py (research.md:
`auto` at two utilizations, `cap`, `refused`, hybrid `auto` on Qwen3.5). On cpu 0.32.0 none of it is called (accounting residency).

- `get_current_vllm_config()` (config/vllm.py): set by `Worker.load_model` around model loading,
  so the engine's first post-load attach sees the worker's resolved config (0.26.0).
- `cache_config.kv_cache_memory_bytes`: when set before `Worker.determine_available_memory`, the
  worker returns it as the KV budget instead of profiling (0.26.0; the startup-plan file is
  skipped too because the field is no longer None). `block_size`, `cache_dtype`,
  `gpu_memory_utilization` are CacheConfig fields in 0.26.0 and 0.32.0.
- `worker.model_runner.profile_run()` and `.model_memory_usage` (GPUModelRunner, 0.26.0): the
  dummy forward of max_num_batched_tokens vLLM itself profiles with (eager, no CUDA graph).
  Model Runner V2 (0.26.0) has both: `load_model` sets `model_memory_usage`
  (v1/worker/gpu/model_runner.py:304), `profile_run` is `_dummy_run(max_num_tokens, skip_attn=True,
  is_profile=True)` (eager: `need_eager=is_profile`) plus a dummy sampler run (:673-688); like DP's
  `execute_dummy_batch` it calls the model runner, not `worker.execute_model`, so the step hook
  (compat.moe.wrap_execute_model) does not see it. Its rows have no slot mapping (skip_attn), so
  the router counters count them: the controller's startup reset runs after the probe (routes.py).
  `cache_config.kv_cache_memory_bytes` is read by the shared `Worker.determine_available_memory`
  (gpu_worker.py:448-480), the same for both runners.
"""

from __future__ import annotations

from typing import Any

import torch

_DTYPE_BYTES = {"fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "bfloat16": 2, "half": 2, "float16": 2}


def current_vllm_config() -> Any:
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config()


def kv_inputs(vllm_config: Any) -> dict:
    """What the KV target depends on, as vLLM resolved it in this worker."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    dtype = str(cc.cache_dtype)
    dtype_bytes = _DTYPE_BYTES.get(dtype) if dtype != "auto" else mc.dtype.itemsize
    if dtype_bytes is None:
        raise ValueError(f"--kv-cache-dtype {dtype}: bytes per element unknown to reap-swap")
    return {
        "hf_text_config": mc.hf_text_config.to_dict(),
        "dtype_bytes": int(dtype_bytes),
        "block_size": int(cc.block_size or 16),
        "tp_size": int(vllm_config.parallel_config.tensor_parallel_size),
        "max_model_len": int(mc.max_model_len),
        "max_num_seqs": int(vllm_config.scheduler_config.max_num_seqs),
        "user_kv_bytes": cc.kv_cache_memory_bytes,
        "utilization": float(cc.gpu_memory_utilization),
    }


def set_kv_cache_memory_bytes(vllm_config: Any, nbytes: int) -> None:
    vllm_config.cache_config.kv_cache_memory_bytes = int(nbytes)


def worker_memory(worker: Any) -> dict:
    """Utilization, KV bytes and weight bytes of a running vLLM GPU worker (0.26.0)."""
    cc = worker.cache_config
    return {
        "utilization": float(cc.gpu_memory_utilization),
        "kv_bytes": int(cc.kv_cache_memory_bytes or 0),
        "weights_bytes": int(getattr(worker.model_runner, "model_memory_usage", 0) or 0),
    }


def profile_activation_peak(worker: Any) -> int:
    """Bytes the profile forward allocates on top of what is allocated now (KV included)."""
    device = torch.cuda.current_device()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    with torch.inference_mode():
        worker.model_runner.profile_run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return int(max(peak, 0))
