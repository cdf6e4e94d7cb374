"""The full-depth phases of research/gpu/gpu_run.sh (branch fulldepth), on the CPU: the memory/time
estimates behind the runbook (research/gpu/fulldepth_budget.py, pure) and a DRY=1 session of the new
and the never-run phases with today's code (model folders, shapes, plans, engine arguments,
gpu_budget_auto.py's arms), which starts no server and kills nothing."""

import dataclasses
import json
from pathlib import Path

import pytest
from harness_modules import load_script
from test_gpu_run_knobs import run_dry_session

from reap_swap.plan.document import load_plan
from reap_swap.sizing.model_shape import read_model_shape

ROOT = Path(__file__).resolve().parents[2]
FIELD_PLAN = ROOT.parent.parent / "shared" / "fixtures" / "strict30-v2-plan.json"
if not FIELD_PLAN.exists():
    FIELD_PLAN = ROOT.parent / "shared" / "fixtures" / "strict30-v2-plan.json"


@pytest.fixture(scope="module")
def fb():
    return load_script("fulldepth_budget")


def test_the_estimate_reproduces_run_10s_measured_qwen3_5_servers(fb):
    q = fb.family("qwen35")
    hbm, host = fb.reap_memory(q, pool_share=2663 / 10240, kv_gib=2)  # the field plan's 2663 slots
    assert abs(hbm - 23.9) < 2.0 and abs(host - 63.3) < 3.0  # run 10: HBM peak 23.9, host 63.3 GiB
    assert abs(fb.stock_memory(q, kv_gib=2)[0] - 68.3) < 1.0  # run 10: stock HBM peak 68.3 GiB


def test_mixtral_full_depth_cannot_sit_beside_its_stock_twin_but_each_fits_alone(fb):
    m = fb.family("mixtral_8x7b")
    assert (m.moe_layers, m.experts, m.expert_gib, m.unit_bytes) == (32, 8, 84.0, 336 * 2**20)
    reap, stock = fb.reap_memory(m), fb.stock_memory(m)
    assert not fb.fits([reap, stock])["ok"] and fb.fits([reap])["ok"] and fb.fits([stock])["ok"]
    assert not fb.fits([fb.reap_memory(m, 0.5), stock])["ok"]  # not even with half the pool
    assert 85 < reap[1] < 95  # host: the experts once, one layer in flight, the process


def test_the_lease_groups_of_the_runbook_fit_side_by_side(fb):
    g, v2, v3 = (fb.family(n) for n in ("gpt_oss_20b", "deepseek_v2_lite", "deepseek_v3_d2"))
    assert g.unit_bytes == 48 * 2**20 and v2.unit_bytes == 18 * 2**20  # 47.46 / 16.5 MiB rounded up
    assert fb.fits([fb.reap_memory(v2), fb.stock_memory(v2), fb.reap_memory(v3)])["ok"]  # v2lite+v3layer
    assert fb.fits([fb.reap_memory(g), fb.stock_memory(g), fb.reap_memory(v2)])["ok"]  # gptossfull+mlacount
    assert not fb.fits([fb.reap_memory(g), fb.stock_memory(g), fb.reap_memory(v2), fb.stock_memory(v2)])["ok"]


def test_point_times_scale_with_what_a_missed_token_reads(fb):
    m = fb.family("mixtral_8x7b")
    assert fb.points_s(m, 4, 16, 16, shares=(1,)) == 10.0  # all resident: nothing over PCIe
    t0 = fb.points_s(m, 4, 16, 16, shares=(0,)) - 10.0
    assert t0 == pytest.approx(2 * 32 * m.expert_bytes / 1e9 / fb.MISS_GBPS * (64 + 16 + 16))
    assert "| mixtral_8x7b | 84.0 |" in "\n".join(fb.rows())


FAMILIES = {  # name -> (MoE layers, experts, eager)
    "gpt_oss_20b": (24, 32, True),
    "mixtral_8x7b": (32, 8, True),
    "deepseek_v2_lite": (26, 64, True),
    "deepseek_v3_d2": (1, 256, True),
}


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    pytest.importorskip("vllm", reason="the Qwen3.5 folder asks vLLM's registry for the text-only class")
    run = tmp_path_factory.mktemp("dry")
    p = run_dry_session(
        run,
        "gptossfull mixfull v2lite+v3layer mlacount hybridauto budget",
        timeout=300,
        HYB_PLAN=str(FIELD_PLAN),
    )
    return run, p


def test_dry_session_runs_every_phase_to_its_end_without_a_server(dry):
    run, p = dry
    assert p.returncode == 0, p.stderr[-2000:]
    for phase in ("gptossfull", "mixfull", "v2lite", "v3layer", "mlacount", "hybridauto", "budget"):
        assert f"phase {phase} exit 0" in p.stdout, p.stdout[-3000:]
    assert (run / "all.done").exists() and "no leftover check" in p.stdout
    log = (run / "dry.log").read_text()
    assert "--arms reap" in log and "--arms stock" in log and "--arms count" in log  # what would serve


@pytest.mark.parametrize("name", FAMILIES)
def test_dry_session_prepares_each_full_depth_family_with_todays_code(dry, name):
    run, _ = dry
    layers, experts, eager = FAMILIES[name]
    meta = json.loads((run / "fam" / name / "meta.json").read_text())
    assert (len(meta["shape"]["moe_layers"]), meta["shape"]["experts"]) == (layers, experts)
    assert ("--enforce-eager" in meta["engine"]) == eager and "--load-format" in meta["engine"]
    model = Path("/tmp/families") / name
    loaded = load_plan(Path(meta["plan"]), read_model_shape(model))  # synthetic: empty core, budget 100 %
    assert sorted(loaded.layers) == meta["shape"]["moe_layers"]
    assert json.loads((run / "fam" / name / "family.json").read_text())["family"] == name


def test_dry_mlacount_serves_v2_lite_under_graphs_and_mixtral_with_fewer_prompts(dry):
    run, _ = dry
    meta = json.loads((run / "mlacount" / "deepseek_v2_lite_graphs" / "meta.json").read_text())
    assert "--enforce-eager" not in meta["engine"] and len(meta["shape"]["moe_layers"]) == 26
    log = (run / "dry.log").read_text()
    mix = [line for line in log.splitlines() if "mixtral_8x7b --out" in line and "--arms reap" in line]
    assert mix and "--prompts 4 --decode-tokens 16" in mix[0] and "--layers 32" in mix[0]


def test_dry_hybridauto_builds_the_full_qwen3_5_folder_and_both_arms(dry):
    run, _ = dry
    if not FIELD_PLAN.exists():
        pytest.skip("the field plan is not on this machine")
    doc = json.loads((run / "hybridauto" / "budget_auto.dry.json").read_text())
    assert doc["plan_found"] and set(doc["arms"]) == {"auto@0.5", "auto@0.85"}
    argv = doc["arms"]["auto@0.85"]
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.85"
    assert "dummy" in argv and "--gdn-prefill-backend" in argv
    assert argv[len(argv) - 1 - argv[::-1].index("--max-model-len") + 1] == "4096"  # the last one wins
    assert read_model_shape(doc["model"]).total_expert_bytes == 60 * 2**30
    assert all(v for v in doc["swap_with_empty_pool"].values())  # a slice per plan layer
    budget = json.loads((run / "budget" / "budget_auto.dry.json").read_text())
    assert not budget["plan_found"] and "refused" in budget["arms"]  # the plan is made on the device


# v3deep / kimideep: the V3 and Kimi-K2 layer shapes at the depth that fits the host, never run on a GPU.
def test_pinned_rounding_reproduces_run_13_and_puts_kimi_depth_3_over_the_host(fb):
    # run 13, Mixtral alone: 103.29 GiB in use at peak from 1.24 idle; run 8, Qwen3.5: 67.2 from 1.8
    assert abs(fb.pinned_host_gib(fb.family("mixtral_8x7b")) - (103.29 - 1.24)) < 1.0
    assert abs(fb.pinned_host_gib(fb.family("qwen35")) - (67.2 - 1.8)) < 1.0
    k = fb.family("kimi_k2_d3")
    assert (k.moe_layers, k.experts, k.expert_gib) == (2, 384, 63.0)
    assert fb.reap_memory(k)[1] == pytest.approx(98.0)  # experts + one layer + process: no rounding
    assert fb.pinned_host_gib(k) == pytest.approx(131.0)  # 2 x (32 + 16) + 31.5 + 3.5
    assert fb.pinned_host_gib(k) > fb.HOST_GIB
    assert fb.pinned_host_gib(dataclasses.replace(k, moe_layers=1)) == pytest.approx(83.0)  # KIMI_LAYERS=2
    assert not fb.fits([fb.reap_memory(k), fb.stock_memory(k)])["ok"]  # 142 GiB of HBM: one at a time


def test_the_launcher_refuses_kimi_depth_3_and_lets_v3_depth_6_start(tmp_path, monkeypatch):
    """The launcher counts vLLM's pinned copies as PyTorch rounds them (host_memory.uva_pinned_bytes):
    Kimi depth 3 needs 96 + 31.5 + 6 GiB and is refused on the lent H200 host before loading; the V3
    layer at depth 6 (3 MoE layers) needs 72 + 21 + 6 and starts."""
    import dataclasses

    from reap_swap.server import host_checks
    from reap_swap.server import launcher as server

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemAvailable:   130516700 kB\n")  # run 11's MemAvailable on the lent H200 host
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    kimi = read_model_shape(ROOT / "tests" / "data" / "kimi_k2_bf16_depth3_config.json")
    with pytest.raises(server.LaunchError, match=r"= 133\.5 GiB"):
        host_checks.check_host_memory(kimi, meminfo, uva_tp=1)
    v3 = read_model_shape(ROOT / "tests" / "data" / "deepseek_v3_bf16_depth5_config.json")
    host_checks.check_host_memory(
        dataclasses.replace(v3, num_layers=6, moe_layers=(3, 4, 5)), meminfo, uva_tp=1
    )


def deep_dry(tmp_path: Path, phase: str, **knobs: str) -> tuple[Path, list[str]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    p = run_dry_session(tmp_path, phase, timeout=180, **knobs)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"phase {phase} exit 0" in p.stdout, p.stdout[-3000:]
    return tmp_path, (tmp_path / "dry.log").read_text().splitlines()


def test_dry_kimideep_prepares_then_stock_then_reap_then_merge(tmp_path):
    run, lines = deep_dry(tmp_path, "kimideep")
    calls = [x for x in lines if x.startswith("DRY research/gpu/gpu_families.py --name kimi_k2_d2 ")]
    arms = [x.split("--arms ")[1].split()[0] for x in calls]
    assert arms == ["prepare", "stock", "reap", "merge"], calls
    for line in calls[:3]:
        assert "--config tests/data/kimi_k2_bf16_depth3_config.json --layers 2" in line and "--eager" in line
        assert "--prompts 4 --decode-tokens 32 --decode-repeats 1" in line
        assert "--kv-gib 0.5 --host-guard-gib 5" in line
    assert "--pinned-conf  " in calls[2]  # no allocator setting: torch 2.11 has none against the rounding
    meta = json.loads((run / "fam" / "kimi_k2_d2" / "meta.json").read_text())
    assert meta["shape"]["moe_layers"] == [1] and meta["shape"]["experts"] == 384
    assert meta["shape"]["expert_gib"] == 31.5 and "--enforce-eager" in meta["engine"]
    loaded = load_plan(Path(meta["plan"]), read_model_shape(Path("/tmp/families") / "kimi_k2_d2"))
    assert sorted(loaded.layers) == [1]
    fr = load_script("families_report")
    plan = json.loads(Path(meta["plan"]).read_text())
    points = [(label, fr.resident_count(plan, active)) for label, active in fr.phases(plan, 384)]
    assert fr.startup_label(plan) == "0" and points == [("25", 96), ("50", 192), ("100", 384), ("again", 0)]
    assert json.loads((run / "fam" / "kimi_k2_d2" / "family.json").read_text())["family"] == "kimi_k2_d2"


def test_dry_v3deep_serves_three_moe_layers_and_takes_the_knobs(tmp_path):
    run, lines = deep_dry(tmp_path, "v3deep", V3DEEP_GRAPHS="1", V3DEEP_PROMPTS="2", V3DEEP_REPEATS="3")
    calls = [x for x in lines if x.startswith("DRY research/gpu/gpu_families.py --name deepseek_v3_d6 ")]
    assert [x.split("--arms ")[1].split()[0] for x in calls] == ["prepare", "stock", "reap", "merge"]
    assert all("--layers 6" in x and "--eager" not in x and "--prompts 2 " in x for x in calls[:3])
    assert "--decode-repeats 3" in calls[2]
    meta = json.loads((run / "fam" / "deepseek_v3_d6" / "meta.json").read_text())
    assert meta["shape"]["moe_layers"] == [3, 4, 5] and meta["shape"]["expert_gib"] == 63.0


def test_dry_v3deep_exact_gives_only_the_reap_arm_exact_pinning(tmp_path):
    _, lines = deep_dry(tmp_path, "v3deep", V3DEEP_EXACT="1")
    calls = [x for x in lines if "research/gpu/gpu_families.py --name deepseek_v3_d6_exact " in x]
    arms = [x.split("--arms ")[1].split()[0] for x in calls]
    assert arms == ["prepare", "stock", "reap", "merge"], calls
    env = [x.startswith("DRY REAP_SWAP_EXACT_PINNING=1 ") for x in calls]
    assert env == [False, False, True, False]
