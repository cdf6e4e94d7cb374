"""--tensor-parallel-size 2 on the CPU build (and --enforce-eager): statistics summed over both
workers without double counting, equal to the independent recount; a swap failing on rank 1
(injected through vLLM's dev route POST /collective_rpc, hence VLLM_SERVER_DEV_MODE=1) leaves both
ranks on the previous set. Runs last: it replaces the main server (one server at a time)."""

import pytest

from .helpers import misses, prefill, status, swap, unique_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2(server_pool):
    # two CPU workers need explicit OpenMP core lists on a one-NUMA-node machine;
    # VLLM_SERVER_DEV_MODE=1 exposes POST /collective_rpc (the fault-injection seam)
    return server_pool.get(
        "tp2-eager",
        ["--tensor-parallel-size", "2", "--enforce-eager"],
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_SERVER_DEV_MODE": "1"},
    )


def test_tp2_eager_aggregates_both_workers_without_double_counting(tp2, recount):
    with tp2.client() as api:
        st = status(api)
        assert [w["tp_rank"] for w in st["workers"]] == [0, 1] and st["workers_consistent"]
        out = swap(api, "tp2-core", {"layer_1": ["layer_1_slice_00"]})
        assert len(out["workers"]) == 2 and out["bytes_copied_per_worker"] == [0, 0]
        before = status(api)
        keep = before["layers"]
        prompt = unique_prompt("tp2-core")
        prefill(api, prompt)
        m = misses(api, "tp2-core")
        # the expert cache runs on each rank from its own routing, no communication: both ranks hold the same
        # slots and totals (ranks_agree compares every layer's resident set), and the prefill's selections
        # reached it exactly once (rank 0's totals, not the two ranks' sum)
        cache = status(api)["cache"]
        assert cache["engaged"] and cache["ranks_agree"], cache
        seen = sum(cache["totals"][k] - before["cache"]["totals"][k] for k in ("hits", "misses"))
        assert seen == len(prompt) * 2 * 4
        assert m["workers"] == 2 and m["tp_disagreement"] == []
        rc = recount.counts(prompt)
        for layer in range(4):
            row = m["layers"][str(layer)]
            assert row["expert_counts"] == rc[layer]  # one worker's worth, not two
            assert row["missed_selections"] == sum(
                c for e, c in enumerate(rc[layer]) if e not in keep[str(layer)]
            )
        assert m["totals"]["observed_selections"] == len(prompt) * 2 * 4


def test_tp2_a_swap_failing_on_rank_1_leaves_both_ranks_on_the_previous_set(tp2):
    with tp2.client() as api:
        before = swap(api, "tp2-fault-a", {"layer_2": ["layer_2_slice_00"]})
        prev = before["signature"]
        assert [w["signature"] for w in before["workers"]] == [prev, prev] and before["workers_consistent"]

        r = api.post("/collective_rpc", json={"method": "reap_arm_swap_fault", "args": [1]})
        assert r.status_code == 200, r.text
        assert [x["armed"] for x in r.json()["results"]] == [False, True]

        target = {"layer_0": ["layer_0_slice_01"], "layer_3": ["layer_3_slice_00"]}
        r = api.post("/swap_active_set", json={"request_id": "tp2-fault-b", "active_set": target})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["type"] == "worker_failed" and err["rolled_back"] is True and err["failed_ranks"] == [1]
        assert "injected swap fault" in err["message"] and err["signature"] == prev
        assert [w["signature"] for w in err["workers"]] == [prev, prev] and err["workers_consistent"]

        st = status(api)
        assert st["signature"] == prev and st["workers_consistent"] and st["failed_count"] >= 1
        assert [(w["tp_rank"], w["signature"]) for w in st["workers"]] == [(0, prev), (1, prev)]
        assert (
            st["workers"][0]["resident_experts"]
            == st["workers"][1]["resident_experts"]
            == st["resident_experts"]
        )

        after = swap(api, "tp2-fault-b", target)  # the fault was one-shot
        new = after["signature"]
        assert new != prev and [w["signature"] for w in after["workers"]] == [new, new]
        st = status(api)
        assert st["signature"] == new and st["workers_consistent"]
        assert [w["signature"] for w in st["workers"]] == [new, new]


def test_tp2_moe_probe_ranks_agree_match_transformers_and_survive_a_swap(tp2, recount):
    """reap_moe_probe (the bitwise MoE-layer comparison used on the GPU): both ranks see the same
    all-reduced block outputs, which are transformers' own MoE blocks' outputs for that input."""
    import torch

    from reap_swap.engine import moe_probe

    def probe(api):
        r = api.post("/collective_rpc", json={"method": "reap_moe_probe", "args": [[1, 8, 64]]})
        assert r.status_code == 200, r.text
        ranks = r.json()["results"]
        assert [x["tp_rank"] for x in ranks] == [0, 1] and not [x for x in ranks if x.get("error")]
        return ranks

    with tp2.client() as api:
        ranks = probe(api)
        assert ranks[0]["layers"] == ranks[1]["layers"] and ranks[0]["inputs"] == ranks[1]["inputs"]
        assert list(ranks[0]["layers"]) == [f"model.layers.{i}.mlp.experts" for i in range(4)]
        for i, layer in enumerate(recount.model.model.layers):
            for n in (1, 8, 64):
                x = moe_probe.probe_input(n, recount.model.config.hidden_size, 0, torch.float32, "cpu")
                with torch.no_grad():
                    y = layer.mlp(x[None])
                y = y[0] if isinstance(y, tuple) else y
                ours = ranks[0]["absmax"][f"model.layers.{i}.mlp.experts"][str(n)]
                assert ours == pytest.approx(float(y.abs().max()), rel=1e-5), (i, n)
        swap(api, "tp2-probe", {"layer_0": ["layer_0_slice_00"], "layer_2": ["layer_2_slice_01"]})
        after = probe(api)
        assert moe_probe.compare_probes(ranks[0], after[0]) == {
            "comparable": True,
            "equal": 12,
            "of": 12,
            "differ": [],
        }
