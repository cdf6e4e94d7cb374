"""gpu_e2e.py's reap-cache-seeded arm against fakes (no server): the flags it serves with and the
sequence of swaps it sends (plain client, core + q/2, core + q, one layer too wide, back to core)."""

from contextlib import contextmanager
from pathlib import Path

import pytest
from harness_modules import load_script


def test_the_seeded_arm_serves_seeded_and_sends_its_swaps(monkeypatch, tmp_path):
    e2e = load_script("gpu_e2e")
    calls = []

    @contextmanager
    def server(name, argv, out, env=None, port=None):
        calls.append(("serve", argv))
        yield type("S", (), {"startup_s": 1.0, "command": argv, "url": "http://x"})()

    monkeypatch.setattr(e2e, "Server", server)
    monkeypatch.setattr(e2e, "make_plan", lambda *a, **k: calls.append(("plan", a[1], k)))
    monkeypatch.setattr(e2e, "status", lambda srv: {"cache": {"policy": "dlfu-seeded"}})
    monkeypatch.setattr(e2e, "open_request", lambda srv, rid: calls.append(("open", rid)))
    monkeypatch.setattr(e2e, "measure", lambda srv, rid, d1=None, d8=None: {"rid": rid})
    monkeypatch.setattr(e2e, "moe_probe", lambda srv, label: None)
    monkeypatch.setattr(e2e, "swap", lambda srv, rid, s: calls.append(("swap", rid, s)) or {"status": 200})
    shape = {"experts": 16, "moe_layers": [1, 3]}
    res = {}
    reap = ["python", "-m", "reap_swap.server", str(Path("/m"))]
    e2e.arm_cache_seeded(reap, tmp_path, shape, res, ["--reap-cache-seed", "seeded"])
    argv = calls[1][1]
    assert argv[argv.index("--reap-cache-seed") + 1] == "seeded"
    swaps = [(c[1], c[2]) for c in calls if c[0] == "swap"]
    assert swaps == [
        ("s-half-tail", {"layer_1": [4, 5], "layer_3": [4, 5]}),
        ("s-full", {"layer_1": [4, 5, 6, 7], "layer_3": [4, 5, 6, 7]}),
        ("s-wide", {"layer_1": [4, 5, 6, 7, 8], "layer_3": []}),
        ("s-core", {}),
    ]
    r = res["reap-cache-seeded"]
    assert (
        r["plain"] == {"rid": "plain", "moe_probe": None} and r["s-full"]["cache"]["policy"] == "dlfu-seeded"
    )


@pytest.mark.parametrize("flag", [[], ["--no-prefix-caching"]])
def test_main_serves_the_seeded_arm_without_any_opt_in(monkeypatch, tmp_path, flag):
    """--arms reap-cache-seeded: the server gets the device cache with --reap-cache-seed seeded and
    no --reap-unverified-seeded-cache (retired in run 23: CUDA serves seeded whenever asked); the
    launcher's own parse of that argv gives the seeded settings, and nothing reap's reaches vLLM."""
    import sys

    from reap_swap.config.flags import resolve, split_argv

    e2e = load_script("gpu_e2e")
    served = []

    @contextmanager
    def server(name, argv, out, env=None, port=None):
        served.append(argv)
        yield type("S", (), {"startup_s": 1.0, "command": argv, "url": "http://x"})()

    monkeypatch.setattr(e2e, "Server", server)
    monkeypatch.setattr(e2e, "make_plan", lambda *a, **k: None)
    monkeypatch.setattr(e2e, "model_shape", lambda model: {"experts": 16, "moe_layers": [1, 3]})
    seed = {"requested": "seeded", "served": "seeded"}
    monkeypatch.setattr(e2e, "status", lambda srv: {"cache": {"policy": "dlfu-seeded", "seed": seed}})
    monkeypatch.setattr(e2e, "open_request", lambda srv, rid: None)
    monkeypatch.setattr(e2e, "measure", lambda srv, rid, d1=None, d8=None: {"rid": rid})
    monkeypatch.setattr(e2e, "moe_probe", lambda srv, label: None)
    monkeypatch.setattr(e2e, "swap", lambda *a: {"status": 200})
    argv = [
        "gpu_e2e.py",
        "--model",
        str(tmp_path),
        "--out",
        str(tmp_path),
        "--arms",
        "reap-cache-seeded",
        *flag,
    ]
    monkeypatch.setattr(sys, "argv", argv)
    e2e.main()
    (cmd,) = served
    # run 25 compared text with prefix caching on; the brief's condition is off: the flag reaches the engine
    assert ("--no-enable-prefix-caching" in cmd) == bool(flag)
    assert "--reap-unverified-seeded-cache" not in cmd
    assert cmd[cmd.index("--reap-cache-seed") + 1] == "seeded"
    ns, vllm_argv = split_argv(cmd[cmd.index("reap_swap.server") + 1 :])
    assert not [a for a in vllm_argv if a.startswith("--reap-")]
    settings = resolve(ns, {}).settings
    assert (settings.cache.policy, settings.cache.device, settings.cache.seed) == ("lfu", "on", "seeded")
    import json

    r = json.loads((tmp_path / "gpu_e2e.json").read_text())["reap-cache-seeded"]
    assert "error" not in r and r["seed"] == seed


def test_the_nocore_arm_serves_the_pinned_cache_on_an_empty_core(monkeypatch, tmp_path):
    """reap-cache-nocore: the pinned device cache (core+dlfu) on a plan whose core is empty, pool
    50 %: nothing pinned, every own unit host-backed (the seeded serve's layout, unseeded, and what
    `plan --cache-tail auto` serves at small budgets); the plain client only, no swaps."""
    import sys

    e2e = load_script("gpu_e2e")
    calls = []

    @contextmanager
    def server(name, argv, out, env=None, port=None):
        calls.append(("serve", name, argv))
        yield type("S", (), {"startup_s": 1.0, "command": argv, "url": "http://x"})()

    monkeypatch.setattr(e2e, "Server", server)
    monkeypatch.setattr(e2e, "make_plan", lambda *a, **k: calls.append(("plan", a[1], k)))
    monkeypatch.setattr(e2e, "model_shape", lambda model: {"experts": 16, "moe_layers": [1, 3]})
    monkeypatch.setattr(e2e, "status", lambda srv: {"cache": {"policy": "core+dlfu"}})
    monkeypatch.setattr(e2e, "open_request", lambda srv, rid: None)
    monkeypatch.setattr(e2e, "measure", lambda srv, rid, d1=None, d8=None: {"rid": rid})
    monkeypatch.setattr(e2e, "moe_probe", lambda srv, label: None)
    monkeypatch.setattr(e2e, "swap", lambda *a: calls.append(("swap",)) or {})
    argv = ["gpu_e2e.py", "--model", str(tmp_path), "--out", str(tmp_path), "--arms", "reap-cache-nocore"]
    monkeypatch.setattr(sys, "argv", argv)
    e2e.main()
    plans = [c for c in calls if c[0] == "plan"]
    assert plans == [("plan", 0.0, {"budget_fraction": 0.5})]
    (served,) = [c[2] for c in calls if c[0] == "serve"]
    assert served[served.index("--reap-cache") + 1] == "lfu" and "--reap-cache-seed" not in served
    assert served[served.index("--reap-cache-device") + 1] == "on"
    assert not [c for c in calls if c[0] == "swap"]
    import json

    r = json.loads((tmp_path / "gpu_e2e.json").read_text())["reap-cache-nocore"]
    assert "error" not in r and r["plain"]["rid"] == "plain"


def test_cache_flags_add_the_shadow_only_when_asked():
    e2e = load_script("gpu_e2e")
    base = ["--reap-cache", "lfu", "--reap-cache-device", "on", "--reap-cache-slots", "auto"]
    assert e2e.cache_flags("off") == base
    assert e2e.cache_flags("out", "--reap-cache-seed", "seeded") == [
        *base, "--reap-cache-seed", "seeded", "--reap-cache-shadow", "out",
    ]  # fmt: skip
