"""KV bytes of a KV target for layouts vLLM groups (hybrid linear/full attention, sliding windows).

Pure (no torch, no vLLM). compat/kv_spec.py reads vLLM's own objects in the worker -- the KV cache
spec of every layer, vLLM's grouping (`get_kv_cache_groups`) and its tensor plan
(`get_kv_cache_config_from_groups`) -- into a `KvGroups`; this module turns it into bytes.

The rule (vLLM 0.26.0 / 0.32.0 `v1/core/kv_cache_utils.py`, read there; the CPU test
tests/test_kv_spec_cpu.py checks it against vLLM's own functions): every KV cache group shares one
pool of `num_blocks` block ids, and one block id costs `bytes_per_block` over all KV tensors
(general hybrid case: `group_size` tensors x one common page; vLLM pads Mamba/GDN state pages and
attention pages to that page). A request takes, in each group, the blocks its spec says
(`max_memory_usage_bytes / page`: attention cdiv(len, block_size), a Gated-DeltaNet/Mamba group one
state block per sequence (two with prefix caching in "align" mode), a sliding-window group the
window's blocks). BlockPool keeps one block as its null block.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

# specs whose blocks grow with every token of a sequence and hold nothing else: only these scale
# with --reap-kv-tokens' pool of tokens; every other group (Mamba/GDN state, sliding windows,
# chunked local attention) is sized per sequence at max_model_len x max_num_seqs
PER_TOKEN_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")


class KvGroupsError(ValueError):
    """A KV layout reap-swap does not size (the message names why); KV target refused."""


@dataclass(frozen=True)
class KvGroup:
    spec: str  # vLLM spec class name (FullAttentionSpec, MambaSpec, SlidingWindowSpec, ...)
    layers: int
    block_size: int  # tokens per block as vLLM resolved it (attention block raised for hybrids)
    page_bytes: int  # one block of one layer, after vLLM's padding
    per_token: bool  # scales with a pool of tokens (see PER_TOKEN_SPECS)
    blocks_per_seq: int  # blocks one sequence of the target length takes in this group


@dataclass(frozen=True)
class KvGroups:
    bytes_per_block: int  # one block id over every KV tensor (vLLM's tensor sizes / num_blocks)
    tensors: int  # KV tensors vLLM allocates (hybrid: the largest group's layer count)
    groups: tuple[KvGroup, ...]

    @property
    def kind(self) -> str:
        names = sorted({g.spec for g in self.groups})
        return "hybrid " + "+".join(names) if len(self.groups) > 1 else names[0] if names else "none"


def per_token_spec(spec_name: str, sliding_window: int | None = None) -> bool:
    return spec_name in PER_TOKEN_SPECS and not sliding_window


def kv_blocks(groups: KvGroups, token_seqs: int, state_seqs: int) -> int:
    """Block ids for `token_seqs` sequences in the per-token groups and `state_seqs` in every
    other group (each group's blocks_per_seq already at its length), plus vLLM's null block."""
    need = sum(g.blocks_per_seq * (token_seqs if g.per_token else state_seqs) for g in groups.groups)
    return 1 + need


def kv_bytes_grouped(groups: KvGroups, token_seqs: int, state_seqs: int) -> int:
    """What to tell vLLM (cache_config.kv_cache_memory_bytes): whole blocks, nothing to round away
    (vLLM's num_blocks = bytes // bytes_per_block, so it allocates exactly these bytes)."""
    if groups.bytes_per_block <= 0 or not groups.groups:
        raise KvGroupsError("no KV cache groups (attention-free model?): nothing to size")
    return kv_blocks(groups, token_seqs, state_seqs) * groups.bytes_per_block


def grouped_source(groups: KvGroups, tokens: int, token_seqs: int, state_seqs: int) -> str:
    """The KV target's description for the log line, the split and /reap/status."""
    parts = ", ".join(
        f"{g.layers}x{g.spec}(block {g.block_size}, page {g.page_bytes} B, {g.blocks_per_seq} blk/seq)"
        for g in groups.groups
    )
    return (
        f"{tokens} tokens x {token_seqs} seqs, {state_seqs} state seqs, {groups.kind}: {parts}; "
        f"{groups.tensors} tensors, {groups.bytes_per_block} B/block, "
        f"{kv_blocks(groups, token_seqs, state_seqs)} blocks"
    )


def needs_vllm_groups(cfg: dict) -> str | None:
    """Why a text config's KV bytes must come from vLLM's grouping (None: the config sum is exact).
    Hybrid linear/full attention (Qwen3-Next, Qwen3.5: layer_types / full_attention_interval) and
    sliding-window layers (GPT-OSS, Mistral's window) are grouped and padded by vLLM."""
    types = list(cfg.get("layer_types") or ())
    if cfg.get("full_attention_interval") or any(t != "full_attention" for t in types):
        return "hybrid attention (layer_types / full_attention_interval)"
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) and not cfg.get("kv_lora_rank"):
        return "sliding-window attention"
    return None


def check_groups(specs: Iterable[str], multi_group: bool, pipeline_parallel: int) -> None:
    """Refuse, by name, the layouts whose per-request blocks vLLM does not compute as above."""
    names = list(specs)
    if pipeline_parallel > 1:
        raise KvGroupsError(
            "pipeline parallel: vLLM groups KV layers over all stages, one worker sees its own; "
            "pass --kv-cache-memory-bytes"
        )
    if multi_group and "UniformTypeKVCacheSpecs" in names:
        raise KvGroupsError(
            "several UniformTypeKVCacheSpecs groups (DeepSeek-V4's packed layout): per-request bytes "
            "are counted per layer tuple there; pass --kv-cache-memory-bytes"
        )
