"""kv_groups.py (pure): KV bytes of a KV target from vLLM's grouping, and the refusals."""

from __future__ import annotations

import pytest

from reap_swap.sizing.kv_groups import (
    KvGroup,
    KvGroups,
    KvGroupsError,
    check_groups,
    grouped_source,
    kv_blocks,
    kv_bytes_grouped,
    needs_vllm_groups,
    per_token_spec,
)
from reap_swap.sizing.memory_split import BudgetError, kv_layout

# Qwen3.5-35B-A3B's text config, as far as the KV layout goes (tests/data/qwen3_5_moe_35b_a3b_config.json)
QWEN35 = {
    "num_hidden_layers": 40,
    "full_attention_interval": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
}


def hybrid(attn_blocks: int, tensors: int = 3, page: int = 1 << 20) -> KvGroups:
    """3 GDN layers : 1 full attention, grouped by vLLM as one state group of 3 and an attention
    group of 1 (padded to 3 tensors), one common page."""
    return KvGroups(
        bytes_per_block=tensors * page,
        tensors=tensors,
        groups=(
            KvGroup("MambaSpec", 3, 512, page, False, 1),
            KvGroup("FullAttentionSpec", 1, 512, page, True, attn_blocks),
        ),
    )


def test_which_configs_need_vllms_grouping():
    assert needs_vllm_groups(QWEN35).startswith("hybrid attention")
    assert needs_vllm_groups({"layer_types": ["sliding_attention", "full_attention"]}).startswith("hybrid")
    assert needs_vllm_groups({"sliding_window": 4096}) == "sliding-window attention"
    assert needs_vllm_groups({"sliding_window": 4096, "use_sliding_window": False}) is None
    assert needs_vllm_groups({"layer_types": ["full_attention"] * 4}) is None
    assert needs_vllm_groups({"kv_lora_rank": 512, "sliding_window": 4096}) is None  # MLA ignores it
    with pytest.raises(BudgetError, match="vLLM's own KV grouping"):  # the config sum still refuses
        kv_layout({**QWEN35, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256}, 2)


def test_bytes_are_whole_blocks_with_the_null_block():
    g = hybrid(attn_blocks=4)  # 2048 tokens at block 512
    # 8 sequences: 8 state blocks + 8 x 4 attention blocks + vLLM's null block
    assert kv_blocks(g, 8, 8) == 1 + 8 * 1 + 8 * 4
    assert kv_bytes_grouped(g, 8, 8) == 41 * 3 * (1 << 20)
    # --reap-kv-tokens as one pool: the attention group once at the pool's length, but every running
    # sequence still needs its GDN state block
    pooled = hybrid(attn_blocks=64)  # 32768 tokens
    assert kv_blocks(pooled, 1, 8) == 1 + 8 + 64
    assert "2048 tokens x 8 seqs" in grouped_source(g, 2048, 8, 8) and "41 blocks" in grouped_source(
        g, 2048, 8, 8
    )
    assert g.kind == "hybrid FullAttentionSpec+MambaSpec"


def test_per_token_specs_and_refusals():
    assert per_token_spec("FullAttentionSpec") and per_token_spec("MLAAttentionSpec")
    assert not per_token_spec("FullAttentionSpec", sliding_window=128)
    assert not per_token_spec("MambaSpec") and not per_token_spec("SlidingWindowSpec")
    with pytest.raises(KvGroupsError, match="no KV cache groups"):
        kv_bytes_grouped(KvGroups(0, 0, ()), 1, 1)
    with pytest.raises(KvGroupsError, match="pipeline parallel"):
        check_groups(["MambaSpec", "FullAttentionSpec"], True, 2)
    with pytest.raises(KvGroupsError, match="DeepSeek-V4"):
        check_groups(["UniformTypeKVCacheSpecs", "UniformTypeKVCacheSpecs"], True, 1)
    check_groups(["UniformTypeKVCacheSpecs"], False, 1)  # one group: vLLM's per-layer sum, fine
