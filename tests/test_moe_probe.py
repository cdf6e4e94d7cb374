"""MoE-layer probe: digests are equal iff outputs are bitwise equal, inputs are the same on every
call, blocks are called in registration order inside one forward context per size."""

import contextlib

import pytest
import torch

from reap_swap import compat
from reap_swap.engine import moe_probe


def test_digest_is_bitwise():
    a = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    assert moe_probe.digest(a) == moe_probe.digest(a.clone())
    b = a.clone()
    b.view(torch.int16)[1] += 1  # the next bf16 after 2.0: one bit of one element
    assert b[1] != a[1] and moe_probe.digest(b) != moe_probe.digest(a)
    assert moe_probe.digest(a.float()) != moe_probe.digest(a)  # same values, other dtype
    assert moe_probe.digest(a.reshape(3, 1)) != moe_probe.digest(a)  # same bytes, other shape
    assert moe_probe.digest(torch.zeros(2)) != moe_probe.digest(-torch.zeros(2))  # -0.0 has other bits


def test_probe_input_depends_only_on_seed_and_size():
    x = moe_probe.probe_input(8, 16, 0, torch.bfloat16, "cpu")
    assert x.shape == (8, 16) and x.dtype == torch.bfloat16
    assert torch.equal(x, moe_probe.probe_input(8, 16, 0, torch.bfloat16, "cpu"))
    assert not torch.equal(x, moe_probe.probe_input(8, 16, 1, torch.bfloat16, "cpu"))
    assert not torch.equal(x[:1], moe_probe.probe_input(1, 16, 0, torch.bfloat16, "cpu"))


class _Block(torch.nn.Module):
    def __init__(self, scale: float, calls: list):
        super().__init__()
        self.experts = torch.nn.Linear(16, 16, bias=False)
        torch.nn.init.constant_(self.experts.weight, scale)
        self.calls, self.scale = calls, scale

    def forward(self, x):
        self.calls.append((self.scale, x.shape[0], _Ctx.depth))
        return self.experts(x)


class _Layer(torch.nn.Module):
    def __init__(self, scale, calls):
        super().__init__()
        self.mlp = _Block(scale, calls)


class _Model(torch.nn.Module):
    def __init__(self, calls):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList([_Layer(0.01 * (i + 1), calls) for i in range(3)])


class _Ctx:
    depth = 0


class _Config:
    class model_config:
        dtype = torch.float32

        @staticmethod
        def get_hidden_size():
            return 16


@pytest.fixture
def fake_vllm(monkeypatch):
    @contextlib.contextmanager
    def ctx(_cfg):
        _Ctx.depth += 1
        try:
            yield
        finally:
            _Ctx.depth -= 1

    names = [f"model.layers.{i}.mlp.experts" for i in (0, 1, 2)]
    monkeypatch.setattr(compat, "moe_layer_names", lambda _cfg: names)
    monkeypatch.setattr(compat, "standalone_forward_context", ctx)


def test_run_probe_calls_each_block_once_per_size_in_order_inside_a_context(fake_vllm):
    calls = []
    out = moe_probe.run_probe(_Model(calls), _Config, tokens=(1, 4), seed=3)
    assert calls == [(0.01, 1, 1), (0.02, 1, 1), (0.03, 1, 1), (0.01, 4, 1), (0.02, 4, 1), (0.03, 4, 1)]
    assert list(out["layers"]) == [f"model.layers.{i}.mlp.experts" for i in range(3)]
    assert all(set(row) == {"1", "4"} for row in out["layers"].values())
    assert len({row["4"] for row in out["layers"].values()}) == 3  # different weights, different outputs
    x = moe_probe.probe_input(4, 16, 3, torch.float32, "cpu")
    expected = moe_probe.digest(x @ torch.full((16, 16), 0.02).T)
    assert out["layers"]["model.layers.1.mlp.experts"]["4"] == expected
    assert out["inputs"]["4"] == moe_probe.digest(x)


def test_compare_probes_names_the_differing_layer_and_size(fake_vllm):
    model = _Model([])
    ref = moe_probe.run_probe(model, _Config, tokens=(1, 4))
    assert moe_probe.compare_probes(ref, moe_probe.run_probe(model, _Config, tokens=(1, 4))) == {
        "comparable": True,
        "equal": 6,
        "of": 6,
        "differ": [],
    }
    with torch.no_grad():
        model.model.layers[2].mlp.experts.weight[0, 0] += 1e-3
    got = moe_probe.compare_probes(ref, moe_probe.run_probe(model, _Config, tokens=(1, 4)))
    assert got == {
        "comparable": True,
        "equal": 4,
        "of": 6,
        "differ": ["model.layers.2.mlp.experts@1", "model.layers.2.mlp.experts@4"],
    }
    other_seed = moe_probe.run_probe(model, _Config, tokens=(1, 4), seed=1)
    assert moe_probe.compare_probes(ref, other_seed)["comparable"] is False


def test_a_layer_without_a_block_is_refused(fake_vllm, monkeypatch):
    monkeypatch.setattr(compat, "moe_layer_names", lambda _cfg: ["model.layers.9.mlp.experts"])
    with pytest.raises(RuntimeError, match="no parent block 'model.layers.9.mlp'"):
        moe_probe.run_probe(_Model([]), _Config)


def test_the_extension_answers_errors_instead_of_raising(fake_vllm, monkeypatch):
    monkeypatch.setattr(compat, "parallel_ranks", lambda _cfg: {"tp_rank": 0, "tp_size": 1, "dp_rank": 0})
    monkeypatch.setattr(compat, "moe_layer_names", lambda _cfg: [])

    class W(moe_probe.MoeProbeExtension):
        vllm_config = _Config

        def get_model(self):
            return _Model([])

    out = W().reap_moe_probe(tokens=["2"])
    assert out == {
        "tp_rank": 0,
        "tp_size": 1,
        "dp_rank": 0,
        "error": "RuntimeError: this model has no registered MoE layers",
    }


def test_the_probe_module_does_not_register_the_counting_layer():
    """A stock server loads MoeProbeExtension alone: its import must not change model building."""
    import subprocess
    import sys

    code = (
        "import reap_swap.engine.moe_probe, sys; "
        "print('reap_swap.engine.worker' in sys.modules, 'reap_swap.engine.routed_experts' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
