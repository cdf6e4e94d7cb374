"""tests/test_device_cache_seeded.py's accounting agreement with the fast Triton policy step (what
serving runs: DeviceCaches(step="triton")), under TRITON_INTERPRET=1 on CPU tensors in a child pytest."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from tests.triton_child import INTERPRETED, run_child_pytest  # noqa: E402

PARENT = "test_seeded_fast_under_the_triton_interpreter"

if not INTERPRETED:

    def test_seeded_fast_under_the_triton_interpreter():
        run_child_pytest(__file__)

else:

    def test_seeded_swaps_agree_with_accounting_on_the_fast_step():
        from tests.test_device_cache_seeded import agreement

        agreement(fused=True)
