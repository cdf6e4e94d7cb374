"""research/gpu/gpu_run.sh knobs the next leases need (branch gpureview), checked with a DRY=1 session:
every python call is only logged to $RUN_DIR/dry.log (research/gpu/dry_py.sh), no server, nothing killed."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_dry_session(
    run_dir: Path, phases: str, timeout: float = 60, **knobs: str
) -> subprocess.CompletedProcess:
    """`gpu_run.sh session` with DRY=1 into `run_dir` (python calls only logged to dry.log)."""
    env = {
        **os.environ, "DRY": "1", "DRY_PYTHON": sys.executable, "RUN_DIR": str(run_dir),
        "PYTHONPATH": str(ROOT), "PHASES": phases, **knobs,
    }  # fmt: skip
    return subprocess.run(
        ["bash", "research/gpu/gpu_run.sh", "session"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def dry_session(tmp_path: Path, phases: str, **knobs: str) -> list[str]:
    tmp_path.mkdir(parents=True, exist_ok=True)  # `session` writes into RUN_DIR (`start` makes it)
    p = run_dry_session(tmp_path, phases, **knobs)
    assert p.returncode == 0, p.stderr[-2000:]
    return (tmp_path / "dry.log").read_text().splitlines()


def _line(lines: list[str], script: str) -> str:
    (line,) = [x for x in lines if x.startswith(f"DRY {script}")]
    return line


def test_quant_extra_reaches_the_quant_driver(tmp_path):
    # lease C: `--decode-tokens 64 --jobs 1 --serial-arms` had no way into ph_quant
    lines = dry_session(
        tmp_path, "quant", QUANT_CASES="fp8-tensor,ct-fp8,fp8-online", QUANT_JOBS="1",
        QUANT_EXTRA="--decode-tokens 64 --serial-arms --case-timeout 600",
    )  # fmt: skip
    line = _line(lines, "research/gpu/gpu_quant_e2e.py")
    assert "--jobs 1 --cases fp8-tensor,ct-fp8,fp8-online --decode-tokens 64 --serial-arms" in line
    assert line.endswith("--case-timeout 600")


def test_quant_without_extra_is_unchanged(tmp_path):
    line = _line(dry_session(tmp_path, "quant"), "research/gpu/gpu_quant_e2e.py")
    assert line.endswith("--jobs 3 --cases fp8-block,fp8-tensor,ct-fp8,fp8-online")


def test_count_startup_timeouts_stay_under_their_caps(tmp_path):
    # MLACOUNT_CAP=420 (lease B) with a fixed --startup-timeout 480: `timeout` would kill a slow
    # start before the driver records it; the default caps keep the old values (480, 500)
    lines = dry_session(tmp_path, "mlacount count", MLACOUNT_CAP="420")
    cmds = [x for x in lines if x.startswith("DRY research/gpu/gpu_families.py")]
    assert any("deepseek_v2_lite_graphs" in x and "--startup-timeout 340 " in x for x in cmds), cmds
    assert any("--name qwen35" in x and "--startup-timeout 500 " in x for x in cmds), cmds
    lines = dry_session(tmp_path / "d", "mlacount")
    assert "--startup-timeout 480 " in _line(lines, "research/gpu/gpu_families.py")


def test_guards_knobs_reach_the_decode_guard(tmp_path):
    # guardfix: 512-token samples x 12 rounds by default; GUARD_* still override, the deadline
    # stays 40 s inside GUARD_CAP
    line = _line(dry_session(tmp_path / "a", "guards"), "research/gpu/gpu_guards.py")
    assert line.endswith("--serves 2 --rounds 12 --tokens 512 --deadline 440")
    line = _line(
        dry_session(tmp_path / "b", "guards", GUARD_SERVES="5", GUARD_CAP="1000", GUARD_ROUNDS="8",
                    GUARD_TOKENS="256"),
        "research/gpu/gpu_guards.py",
    )  # fmt: skip
    assert line.endswith("--serves 5 --rounds 8 --tokens 256 --deadline 960")


def test_quant2_runs_a_second_configuration_after_quant(tmp_path):
    # lease after run 16: online FP8 without groups, then INT4 with --reap-group-size auto, one session
    lines = dry_session(
        tmp_path, "quant quant2", QUANT_CASES="fp8-online", QUANT_JOBS="1", QUANT_EXTRA="--layers 12",
        QUANT2_CASES="awq,gptq", QUANT2_EXTRA="--layers 12 --reap-group-size auto",
    )  # fmt: skip
    cmds = [x for x in lines if x.startswith("DRY research/gpu/gpu_quant_e2e.py")]
    assert len(cmds) == 2, cmds
    assert "--out " in cmds[0] and "/quant --jobs 1 --cases fp8-online --layers 12" in cmds[0]
    assert "/quant2 --jobs 1 --cases awq,gptq --layers 12 --reap-group-size auto" in cmds[1]


def wait_for_session(run_dir: Path, tries: int = 100) -> None:
    """Until the background session `start` launched marks all.done (0.2 s a try)."""
    for _ in range(tries):
        if (run_dir / "all.done").exists():
            break
        time.sleep(0.2)


def test_start_runs_the_session_from_a_private_copy_of_the_tree(tmp_path):
    # run 17: a `wait` call re-synced the repo root while the session started a phase, and the phase's
    # script was missing for that moment; the session now runs from RUN_TREE, which no call touches
    run_dir, tree = tmp_path / "run", tmp_path / "tree"
    env = {
        **os.environ, "DRY": "1", "DRY_PYTHON": sys.executable, "RUN_DIR": str(run_dir),
        "RUN_TREE": str(tree), "PYTHONPATH": str(ROOT), "PHASES": "quant",
    }  # fmt: skip
    subprocess.run(["bash", "research/gpu/gpu_run.sh", "start"], cwd=ROOT, env=env, check=True, timeout=60)
    wait_for_session(run_dir, tries=300)
    log = (run_dir / "main.log").read_text()
    assert f"session tree: {tree}" in log and "phase quant exit 0" in log
    assert (tree / "research" / "gpu" / "gpu_quant_e2e.py").is_file()
    assert "DRY research/gpu/gpu_quant_e2e.py" in (run_dir / "dry.log").read_text()


def small_tree(tmp_path: Path) -> Path:
    """A working tree with the run scripts only, plus a git-ignored-style venv the copy must leave out."""
    tree = tmp_path / "repo"
    (tree / "research" / "gpu").mkdir(parents=True)
    for name in ("gpu_run.sh", "gpu_inputs.txt", "gpu_lease_tree.sh", "dry_py.sh"):
        (tree / "research" / "gpu" / name).write_bytes((ROOT / "research" / "gpu" / name).read_bytes())
    (tree / ".venv-vllm026" / "lib").mkdir(parents=True)
    (tree / ".venv-vllm026" / "lib" / "big.so").write_bytes(b"x" * 1024)
    return tree


def test_start_leaves_every_venv_out_of_the_session_copy(tmp_path):
    # CI at f5700e7: the checkout's .venv-vllm026 (GBs, the 0.26.0 e2e leg's venv) went into RUN_TREE and
    # `start` ran past this file's 60 s timeout; only ./.venv was excluded
    tree, run_dir, copy = small_tree(tmp_path), tmp_path / "run", tmp_path / "copy"
    env = {
        **os.environ, "DRY": "1", "DRY_PYTHON": sys.executable, "RUN_DIR": str(run_dir),
        "RUN_TREE": str(copy), "PHASES": "quant",
    }  # fmt: skip
    subprocess.run(["bash", "research/gpu/gpu_run.sh", "start"], cwd=tree, env=env, check=True, timeout=60)
    assert (copy / "research" / "gpu" / "gpu_run.sh").is_file()
    assert not (copy / ".venv-vllm026").exists()
    wait_for_session(run_dir)


def test_start_refuses_a_phase_whose_input_the_tree_lacks(tmp_path):
    tree, run_dir = small_tree(tmp_path), tmp_path / "run"
    env = {**os.environ, "DRY": "1", "RUN_DIR": str(run_dir), "RUN_TREE": str(tmp_path / "copy"),
           "PHASES": "quant+cache skewbench guards"}  # fmt: skip
    res = subprocess.run(
        ["bash", "research/gpu/gpu_run.sh", "start"], cwd=tree, env=env, capture_output=True, text=True
    )
    assert res.returncode == 2
    assert "phase skewbench reads research-notes/h200-2026-11-30/skew.plan.json" in res.stderr
    assert "phase cache reads research-notes/h200-2026-12-01/run8-gpu_e2e.json" in res.stderr
    assert "guards" not in res.stderr and not run_dir.exists() and not (tmp_path / "copy").exists()
    # the same tree with the inputs present starts
    for rel in (
        "research-notes/h200-2026-11-30/skew.plan.json",
        "research-notes/h200-2026-12-01/run8-gpu_e2e.json",
    ):
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text("{}")
    env["PHASES"] = "skewbench"
    env["DRY_PYTHON"] = sys.executable
    subprocess.run(["bash", "research/gpu/gpu_run.sh", "start"], cwd=tree, env=env, check=True, timeout=60)
    wait_for_session(run_dir)
    assert "DRY research/gpu/gpu_skew_bench.py" in (run_dir / "dry.log").read_text()


def test_lease_tree_holds_research_notes_but_keeps_what_phases_read(tmp_path):
    tree, hold = small_tree(tmp_path), tmp_path / "hold"
    notes = tree / "research-notes"
    for rel in ("h200-2026-11-30/skew.plan.json", "h200-2026-12-01/run8-gpu_e2e.json", "big/raw.log"):
        (notes / rel).parent.mkdir(parents=True, exist_ok=True)
        (notes / rel).write_text(rel)
    env = {**os.environ, "HOLD": str(hold)}
    subprocess.run(["bash", "research/gpu/gpu_lease_tree.sh", "hold"], cwd=tree, env=env, check=True)
    kept = sorted(str(p.relative_to(notes)) for p in notes.rglob("*") if p.is_file())
    assert kept == ["h200-2026-11-30/skew.plan.json", "h200-2026-12-01/run8-gpu_e2e.json"]
    assert (hold / "big" / "raw.log").read_text() == "big/raw.log"
    again = subprocess.run(
        ["bash", "research/gpu/gpu_lease_tree.sh", "hold"], cwd=tree, env=env, capture_output=True
    )
    assert again.returncode == 2  # a second hold would lose the first
    subprocess.run(["bash", "research/gpu/gpu_lease_tree.sh", "restore"], cwd=tree, env=env, check=True)
    assert (notes / "big" / "raw.log").is_file() and not hold.exists()


def test_wait_on_a_machine_without_a_run_stops_at_once(tmp_path):
    # run 21: the second call landed on a freshly lent machine (the last one went back after its idle
    # release) and `wait 540` waited the whole limit on a run that was not there
    env = {**os.environ, "RUN_DIR": str(tmp_path / "run"), "OUT": str(tmp_path / "out")}
    t0 = time.monotonic()
    p = subprocess.run(
        ["bash", "research/gpu/gpu_run.sh", "wait", "30"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=25,
    )
    assert p.returncode == 3, p.stderr
    assert "main.log missing" in p.stderr and "lent fresh" in p.stderr
    assert time.monotonic() - t0 < 10


def _fake_card(tmp_path: Path, name: str) -> str:
    """A PATH whose nvidia-smi names `name` (and reports 0 MiB in use to any other query)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    smi = bindir / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\ncase "$*" in *name*) echo "{name}" ;; *) echo 0 ;; esac\n')
    smi.chmod(0o755)
    return f"{bindir}:{os.environ['PATH']}"


def test_cache_phase_serves_stock_first_on_a_card_other_than_the_h200(tmp_path):
    # run 24: run 8's stock text is an H200's; an H100 serves other bits at every residency
    path = _fake_card(tmp_path / "h100", "NVIDIA H100 80GB HBM3")
    lines = dry_session(tmp_path / "h100", "cache", CACHE_ARMS="reap-sweep", PATH=path)
    assert "--arms stock-gpu,reap-sweep" in _line(lines, "research/gpu/gpu_e2e.py")
    assert not any("run8-gpu_e2e.json" in x for x in lines)
    path = _fake_card(tmp_path / "h200", "NVIDIA H200")
    lines = dry_session(tmp_path / "h200", "cache", CACHE_ARMS="reap-sweep", PATH=path)
    assert "--arms reap-sweep " in _line(lines, "research/gpu/gpu_e2e.py") + " "
    assert any("run8-gpu_e2e.json" in x for x in lines)
    lines = dry_session(
        tmp_path / "given", "cache", CACHE_ARMS="stock-gpu,reap-sweep", PATH=path, CACHE_STOCK="serve"
    )
    assert "--arms stock-gpu,reap-sweep " in _line(lines, "research/gpu/gpu_e2e.py") + " "


def test_qwen_reap_extra_reaches_the_reap_server_arm(tmp_path):
    # run 24's next lease: the device cache on full-size Qwen3.5 needs reap-server flags in the qwen phase
    plan = ROOT.parent / "shared" / "fixtures" / "strict30-v2-plan.json"
    if not plan.exists():
        pytest.skip("the field plan is not on this machine")
    lines = dry_session(
        tmp_path, "qwen", QWEN_REAP_EXTRA="--reap-cache lfu --reap-cache-device on", QWEN_CAP="300"
    )
    reap = [x for x in lines if "--arms reap" in x and "--name qwen35" in x]
    assert reap and reap[0].endswith("--reap-extra --reap-cache lfu --reap-cache-device on"), reap
    stock = [x for x in lines if "--arms stock" in x]
    assert stock and "--reap-extra" not in stock[0]
    log = (tmp_path / "fam" / "qwen35-reap.log").read_text()
    assert "unrecognized arguments" not in log and "Traceback" not in log, log[-2000:]


def _qwen_arms(tmp_path: Path, hbm_mib: int | None, cap: str | None = "900") -> tuple[list[str], str]:
    """The qwen phase's gpu_families.py arms in call order, and the lane's log; `hbm_mib`: what a
    fake nvidia-smi reports as the card's memory (None: no nvidia-smi, as on this machine)."""
    knobs = {"QWEN_CAP": cap} if cap else {}
    if hbm_mib is not None:
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\necho {hbm_mib}\n")
        (bin_dir / "nvidia-smi").chmod(0o755)
        knobs["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    run = tmp_path / "run"
    lines = dry_session(run, "qwen", **knobs)
    arms = [x.split("--arms ")[1].split()[0] for x in lines if "--name qwen35" in x and "--arms " in x]
    return arms, (run / "qwen.log").read_text()


def test_qwen_on_a_card_under_120_gib_serves_reap_first_then_stock(tmp_path):
    # run 26 (H100 80 GB): stock held 65 GiB beside reap-swap, whose plan's pool then did not fit
    if not (ROOT.parent / "shared" / "fixtures" / "strict30-v2-plan.json").exists():
        pytest.skip("the field plan is not on this machine")
    arms, log = _qwen_arms(tmp_path / "h100", 81559)
    assert arms == ["prepare", "reap", "stock", "merge"], log
    assert "79 GiB card: reap first, then stock" in log
    caps = [int(x.split("(cap ")[1].split("s)")[0]) for x in log.splitlines() if "start (cap" in x]
    assert len(caps) == 2 and caps[0] >= 500 and caps[1] >= 300, log  # both arms fit QWEN_CAP=900
    arms, log = _qwen_arms(tmp_path / "none", None)  # no nvidia-smi: the careful order too
    assert arms == ["prepare", "reap", "stock", "merge"], log
    _, log = _qwen_arms(tmp_path / "default", 81559, cap=None)  # no QWEN_CAP: 900 s on this card
    caps = [int(x.split("(cap ")[1].split("s)")[0]) for x in log.splitlines() if "start (cap" in x]
    assert caps[0] >= 500 and sum(caps) >= 800, log


def test_qwen_on_an_h200_serves_both_side_by_side(tmp_path):
    if not (ROOT.parent / "shared" / "fixtures" / "strict30-v2-plan.json").exists():
        pytest.skip("the field plan is not on this machine")
    arms, log = _qwen_arms(tmp_path, 143771)
    assert sorted(arms) == ["merge", "prepare", "reap", "stock"] and arms[-1] == "merge", log
    assert "reap first" not in log


def test_a_repeated_phase_keeps_the_earlier_runs_log_and_output(tmp_path):
    # run 25: "swapguard tests swapguard" left only the second guard's swapguard.log and guards/
    guards = tmp_path / "guards"
    guards.mkdir(parents=True)
    (guards / "swap_guard.json").write_text("first")
    (tmp_path / "swapguard.log").write_text("first guard")
    dry_session(tmp_path, "swapguard tests swapguard")
    assert (tmp_path / "swapguard.run1.log").read_text() == "first guard"
    assert (tmp_path / "guards.run1" / "swap_guard.json").read_text() == "first"
    assert (tmp_path / "swapguard.run2.log").exists() and (tmp_path / "swapguard.log").exists()
    assert not (tmp_path / "tests.run1.log").exists()  # a phase run once is left where it was
    main = (tmp_path / "dry.log").read_text()
    assert main.count("research/gpu/gpu_swap_guard.py") == 2


def test_guards_after_swapguard_keeps_the_shared_guards_folder(tmp_path):
    # guards and swapguard both write guards/: the later phase keeps the earlier one's folder
    (tmp_path / "guards").mkdir(parents=True)
    (tmp_path / "guards" / "swap_guard.json").write_text("swapguard's")
    (tmp_path / "swapguard.log").write_text("x")
    dry_session(tmp_path, "guards", GUARD_CAP="60")
    assert (tmp_path / "guards.run1" / "swap_guard.json").read_text() == "swapguard's"
    assert (tmp_path / "swapguard.log").read_text() == "x"  # another phase's log is not touched


def test_qcache_writes_each_format_then_serves_the_cache_arms_against_stock(tmp_path):
    lines = dry_session(tmp_path, "qcache")
    ckpt = [x for x in lines if x.startswith("DRY scripts/make_quant_checkpoint.py")]
    e2e = [x for x in lines if x.startswith("DRY research/gpu/gpu_e2e.py")]
    assert [x.split("--format ")[1].split()[0] for x in ckpt] == ["fp8-block", "fp8-tensor"]
    assert len(e2e) == 2 and all("--moe-probe --no-prefix-caching" in x for x in e2e)
    assert e2e[0].endswith("--arms stock-gpu,reap-cache,reap-cache-seeded")
    assert f"--model {tmp_path}/qcache/checkpoints/fp8-block --out {tmp_path}/qcache/fp8-block" in e2e[0]
    one = dry_session(tmp_path / "one", "qcache", QCACHE_FORMATS="ct-fp8", QCACHE_ARMS="stock-gpu,reap-cache")
    assert _line(one, "research/gpu/gpu_e2e.py").endswith("--arms stock-gpu,reap-cache")


def test_qcache_fp8_online_serves_the_bf16_checkpoint_with_online_quantization_in_every_arm(tmp_path):
    lines = dry_session(tmp_path, "qcache", QCACHE_FORMATS="fp8-online fp8-block")
    ckpt = [x for x in lines if x.startswith("DRY scripts/make_quant_checkpoint.py")]
    e2e = [x for x in lines if x.startswith("DRY research/gpu/gpu_e2e.py")]
    assert [x.split("--format ")[1].split()[0] for x in ckpt] == ["bf16", "fp8-block"]
    assert f"--model {tmp_path}/qcache/checkpoints/bf16 --out {tmp_path}/qcache/fp8-online" in e2e[0]
    assert "--no-prefix-caching --quantization fp8 --arms" in e2e[0]
    assert "--quantization" not in e2e[1]  # a checkpoint's own format gets no online quantization
    shadow = dry_session(
        tmp_path / "shadow", "qcache", QCACHE_FORMATS="fp8-online", QCACHE_EXTRA="--cache-shadow out"
    )
    assert "--quantization fp8 --cache-shadow out --arms" in _line(shadow, "research/gpu/gpu_e2e.py")


def test_gptossfull_takes_plan_flags_and_reap_only_flags(tmp_path):
    lines = dry_session(
        tmp_path, "gptossfull", GPTOSS_SERIAL="1", GPTOSS_GRAPHS="1",
        GPTOSS_ARGS="--plan-core 0.25 --plan-budget 0.5",
        GPTOSS_REAP_EXTRA="--reap-cache lfu --reap-cache-device on",
    )  # fmt: skip
    fam = [x for x in lines if x.startswith("DRY research/gpu/gpu_families.py") and "gpt_oss_20b" in x]
    arms = {x.split("--arms ")[1].split()[0]: x for x in fam}
    assert {"prepare", "reap", "stock"} <= set(arms)
    for line in (arms["prepare"], arms["reap"], arms["stock"]):
        assert "--plan-core 0.25 --plan-budget 0.5" in line and "--eager" not in line
    assert "--reap-extra --reap-cache lfu --reap-cache-device on" in arms["reap"]
