"""The host-memory check before loading (issue 15 item 4): numbers from research.md run 8."""

from pathlib import Path

import pytest

from reap_swap.server import host_checks
from reap_swap.server.launcher import LaunchError
from reap_swap.sizing.host_memory import (
    GIB,
    PROCESS_MARGIN_BYTES,
    HostMemoryNeed,
    alloc_conf,
    mem_available_bytes,
    pow2_ceil,
    round_threshold_bytes,
    uva_pinned_bytes,
)
from reap_swap.sizing.model_shape import read_model_shape

QWEN35 = Path(__file__).parent / "data" / "qwen3_5_moe_35b_a3b_config.json"
MEMINFO = "MemTotal:       131963392 kB\nMemFree:        1000 kB\nMemAvailable:   130023424 kB\n"


def test_mem_available_is_read_in_bytes():
    assert mem_available_bytes(MEMINFO) == 130023424 * 1024
    assert mem_available_bytes("MemTotal: 1 kB\n") is None


def test_qwen35_full_size_fits_the_h200_host_and_not_a_64_gib_one():
    shape = read_model_shape(QWEN35)
    assert shape.total_expert_bytes == 60 * GIB  # 40 layers x 256 experts x 6 MiB
    # run 8: 125.9 GiB total, 124 GiB available before start; the peak in use was 67.2 GiB
    fits = HostMemoryNeed(shape.total_expert_bytes, shape.layer_expert_bytes, 124 * GIB)
    assert fits.refusal() is None
    assert fits.needed_bytes == 60 * GIB + int(1.5 * GIB) + PROCESS_MARGIN_BYTES
    small = HostMemoryNeed(shape.total_expert_bytes, shape.layer_expert_bytes, 64 * GIB)
    why = small.refusal()
    assert why is not None and "60.0 GiB" in why and "67.5 GiB" in why and "64.0 GiB is available" in why


def test_the_launcher_refuses_before_loading(tmp_path):
    shape = read_model_shape(QWEN35)
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   33554432 kB\n")  # 32 GiB
    with pytest.raises(LaunchError, match="cannot hold the model's experts"):
        host_checks.check_host_memory(shape, meminfo)
    meminfo.write_text(MEMINFO)
    host_checks.check_host_memory(shape, meminfo)  # 124 GiB: fits
    host_checks.check_host_memory(shape, tmp_path / "absent")  # unreadable: warned, not refused


DATA = Path(__file__).parent / "data"


def test_pinned_blocks_round_up_to_powers_of_two():
    """H200, torch 2.11 (research-notes/pinned-round/probe.jsonl): 600 MiB pinned as 1024, 2600 as 4096."""
    assert pow2_ceil(600 * 2**20) == 1024 * 2**20 and pow2_ceil(2600 * 2**20) == 4096 * 2**20
    assert pow2_ceil(2**30) == 2**30 and pow2_ceil(1) == 1 and pow2_ceil(0) == 0
    assert round_threshold_bytes(None) is None and round_threshold_bytes("expandable_segments:True") is None
    conf = "pinned_max_round_threshold_mb:1024,pinned_max_cached_size_mb: 64"
    assert round_threshold_bytes(conf) == 64 * 2**20
    # torch 2.9+ reads PYTORCH_ALLOC_CONF first, PYTORCH_CUDA_ALLOC_CONF as the fallback
    both = {"PYTORCH_ALLOC_CONF": "pinned_max_round_threshold_mb:8", "PYTORCH_CUDA_ALLOC_CONF": "x:1"}
    assert (
        alloc_conf(both) == both["PYTORCH_ALLOC_CONF"]
        and alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "x:1"}) == "x:1"
    )
    assert alloc_conf({}) is None


def _pinned(shape, layers=None, tp=1, threshold=None):
    f = shape.expert_format
    return uva_pinned_bytes(f.w13, f.w2, shape.num_experts, layers or len(shape.moe_layers), tp, threshold)


def test_uva_pinned_bytes_match_run_13_mixtral_and_run_8_qwen35():
    mixtral = read_model_shape(DATA / "mixtral_8x7b_config.json")  # 8 x 336 MiB a layer, 32 layers
    assert mixtral.total_expert_bytes == 84 * GIB
    # w13 1.75 GiB -> 2, w2 0.875 -> 1: 96 GiB pinned (run 13: 102.05 GiB in use = 96 + 6.05 process)
    assert _pinned(mixtral) == 96 * GIB
    assert _pinned(mixtral, tp=2) == 96 * GIB  # 1 + 0.5 GiB per rank
    assert _pinned(mixtral, threshold=2**30) == 88 * GIB  # w2 (0.875) still rounded
    assert _pinned(mixtral, threshold=2**29) == 84 * GIB  # both exact
    qwen = read_model_shape(QWEN35)  # 1 GiB + 0.5 GiB a layer: powers of two already
    assert _pinned(qwen) == qwen.total_expert_bytes
    v3 = read_model_shape(DATA / "deepseek_v3_bf16_depth5_config.json")  # 14 + 7 GiB a layer -> 16 + 8
    assert _pinned(v3) == 2 * 24 * GIB


def test_kimi_k2_depth3_is_refused_on_the_h200_host_with_the_rounding_named(tmp_path, monkeypatch):
    """63 GiB of experts pin as 96 (21 -> 32, 10.5 -> 16 GiB a layer) + a 31.5 GiB layer + 6 = 133.5 GiB
    against the H200 machine's ~124.5 GiB available: refused before loading, not killed mid-load."""
    shape = read_model_shape(DATA / "kimi_k2_bf16_depth3_config.json")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)  # 124 GiB available
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    host_checks.check_host_memory(shape, meminfo)  # the engine's exact copies only: 100.5 GiB fits
    with pytest.raises(LaunchError) as err:
        host_checks.check_host_memory(shape, meminfo, uva_tp=1)
    msg = str(err.value)
    assert "96.0 GiB (63.0 GiB of experts" in msg and "power of two" in msg and "133.5 GiB" in msg
    # a torch that knows pinned_max_round_threshold_mb pins exactly above it; PYTORCH_ALLOC_CONF wins
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "pinned_max_round_threshold_mb:1024")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    host_checks.check_host_memory(shape, meminfo, uva_tp=1)
    need = HostMemoryNeed(shape.total_expert_bytes, shape.layer_expert_bytes, 124 * GIB, 96 * GIB)
    assert need.needed_bytes == int(133.5 * GIB)


def test_v3_layer_at_depth_6_starts_on_the_h200_host(tmp_path, monkeypatch):
    """The v3deep phase: 3 MoE layers of 21 GiB pin as 3 x (16 + 8) = 72 GiB, + 21 + 6 = 99 GiB <= 124."""
    import dataclasses

    shape = read_model_shape(DATA / "deepseek_v3_bf16_depth5_config.json")
    deep = dataclasses.replace(shape, num_layers=6, moe_layers=(3, 4, 5))
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    host_checks.check_host_memory(deep, meminfo, uva_tp=1)
    assert _pinned(deep) == 72 * GIB
