"""The host-memory check before loading (issue 15 item 4): numbers from research.md run 8."""

from pathlib import Path

import pytest

from reap_swap import server
from reap_swap.host_memory import GIB, PROCESS_MARGIN_BYTES, HostMemoryNeed, mem_available_bytes
from reap_swap.model_shape import read_model_shape
from reap_swap.server import LaunchError

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
        server.check_host_memory(shape, meminfo)
    meminfo.write_text(MEMINFO)
    server.check_host_memory(shape, meminfo)  # 124 GiB: fits
    server.check_host_memory(shape, tmp_path / "absent")  # unreadable: warned, not refused
