"""Runs first (file order): the server as it comes up, before any other test sends traffic."""

from .helpers import misses, status, swap


def test_startup_state_and_warmup_does_not_pollute_statistics(server, api):
    st = status(api)
    assert st["mode"] == "accounting"
    assert st["swap_count"] == 0 and st["open_request"] is None
    assert st["workers_consistent"] and len(st["workers"]) == 1
    # the CPU build has no Triton, so vLLM runs its V1 model runner (compat/runner.py)
    runner = st["workers"][0]["runner"]
    assert runner["model_runner"] == "v1" and runner["notes"] == [], runner
    assert runner["padding_mask"] == "slot_mapping" and runner["class"].endswith("ModelRunner"), runner
    # resident at startup = the plan's core; nothing counted since the plugin reset the
    # counters after vLLM's warm-up / profiling forward passes
    assert st["resident_experts"] == 16
    assert st["unattributed_selections"] == 0
    opened = swap(api, "startup-probe", {})
    assert opened["noop"] is True  # core only == what is resident
    m = misses(api, "startup-probe")
    assert m["totals"]["observed_selections"] == 0
    print(f"\n[e2e] startup of the tp1 server took {server.startup_seconds:.1f}s")
