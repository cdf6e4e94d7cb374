"""The GPU survey's worker-side inspection on fake vLLM layers (CPU): what it records per MoE layer
and that it hands the binding classifier the right description."""

from __future__ import annotations

import torch
from harness_modules import load_script

survey = load_script("gpu_quant_survey")

E, H, N = 4, 512, 256  # w2 slab 128 KiB: above the keep-whole threshold


class TritonExperts:  # name-matched, as type(...).__name__ is what the survey records
    pass


class Fp8MoEMethod:
    is_monolithic = False
    fp8_backend = "Fp8MoeBackend.TRITON"

    def __init__(self):
        self.moe_kernel = type("FusedMoEKernel", (), {"fused_experts": TritonExperts()})()


class FakeRoutedExperts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.quant_method = Fp8MoEMethod()
        self.local_num_experts, self.hidden_size, self.intermediate_size_per_partition = E, H, N
        p = torch.nn.Parameter
        self.w13_weight = p(torch.zeros(E, 2 * N, H, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.w2_weight = p(torch.zeros(E, H, N, dtype=torch.float8_e4m3fn), requires_grad=False)
        self.w13_weight_scale_inv = p(torch.ones(E, 2 * N // 128, H // 128), requires_grad=False)
        self.w2_weight_scale_inv = p(torch.ones(E, H // 128, N // 128), requires_grad=False)
        self.w13_input_scale = None  # vLLM sets plain None attributes too
        self.w13_alias = self.w13_weight  # like AWQ's w13_weight = w13_qweight


class Worker:
    def get_model(self):
        m = torch.nn.Module()
        m.experts = FakeRoutedExperts()
        return m


FP8_BLOCK = {"quant_method": "fp8", "weight_block_size": [128, 128]}


def test_worker_records_method_kernel_tensors_and_binding():
    (rec,) = survey.survey_worker(Worker(), FP8_BLOCK)
    assert rec["method"] == "Fp8MoEMethod" and rec["experts"] == "TritonExperts"
    assert rec["backends"] == {"fp8_backend": "Fp8MoeBackend.TRITON"}
    names = {t["name"]: t for t in rec["tensors"]}
    assert names["w13_weight"]["strides"] == [2 * N * H, H, 1]
    assert names["w13_weight"]["storage_bytes"] == E * 2 * N * H
    assert "w13_input_scale" not in names
    b = rec["binding"]
    assert b["ok"], b
    assert b["stride_mode"] == "strided"
    assert sorted(b["rehome"]) == ["w13_weight", "w2_weight"]
    assert sorted(b["keep_whole"]) == ["w13_weight_scale_inv", "w2_weight_scale_inv"]


def test_monolithic_kernel_is_refused_by_name():
    w = Worker()
    model = w.get_model()
    model.experts.quant_method.is_monolithic = True
    w.get_model = lambda: model
    (rec,) = survey.survey_worker(w, FP8_BLOCK)
    assert rec["binding"]["stride_mode"] == "opaque"
    assert set(rec["binding"]["refusal"].split("; ")[0].split(":")[:1]) == {"w13_weight"}


def test_wrapped_tensor_is_described_through_its_storage():
    data = torch.zeros(E, 8, 16, dtype=torch.uint8)
    wrapper = type("Tensor", (), {"storage": type("S", (), {"data": data})(), "shape": (E, 16, 8)})()
    d = survey._describe("w13_weight", wrapper)
    assert d["wrapped"] and d["shape"] == [E, 8, 16] and d["wrapper_shape"] == [E, 16, 8]


def test_llm_kwargs_per_case():
    kw = survey.llm_kwargs("fp8-block")
    assert kw["moe_backend"] == "triton" and kw["enforce_eager"] and kw["kv_cache_memory_bytes"]
    assert survey.llm_kwargs("awq-moe_wna16")["quantization"] == "moe_wna16"
    assert "moe_backend" not in survey.llm_kwargs("fp8-block", cpu_smoke=True)


def test_summary_line():
    ok = {"case": "x", "ok": True, "layers": [{"method": "M", "experts": "K", "binding": {"ok": True}}]}
    assert "bindable" in survey._summary_line(ok)
    assert "vLLM failed" in survey._summary_line({"case": "y", "ok": False, "error": "boom"})
