"""--tensor-parallel-size 2 on the CPU build (and --enforce-eager): statistics summed over both
workers without double counting, equal to the independent recount. Runs last: it replaces the
main server (one server at a time)."""

import pytest

from .helpers import misses, prefill, status, swap, unique_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp2(server_pool):
    # two CPU workers need explicit OpenMP core lists on a one-NUMA-node machine
    return server_pool.get("tp2-eager", ["--tensor-parallel-size", "2", "--enforce-eager"],
                           env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def test_tp2_eager_aggregates_both_workers_without_double_counting(tp2, recount):
    with tp2.client() as api:
        st = status(api)
        assert [w["tp_rank"] for w in st["workers"]] == [0, 1] and st["workers_consistent"]
        out = swap(api, "tp2-core", {"layer_1": ["layer_1_slice_00"]})
        assert len(out["workers"]) == 2 and out["bytes_copied_per_worker"] == [0, 0]
        keep = status(api)["layers"]
        prompt = unique_prompt("tp2-core")
        prefill(api, prompt)
        m = misses(api, "tp2-core")
        assert m["workers"] == 2 and m["tp_disagreement"] == []
        rc = recount.counts(prompt)
        for layer in range(4):
            row = m["layers"][str(layer)]
            assert row["expert_counts"] == rc[layer]  # one worker's worth, not two
            assert row["missed_selections"] == sum(c for e, c in enumerate(rc[layer]) if e not in keep[str(layer)])
        assert m["totals"]["observed_selections"] == len(prompt) * 2 * 4
