"""GPU-only tests: skipped without CUDA, cuda-python and vLLM (run them on the H200, see research.md)."""

import pytest


def _gpu_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch not installed"
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        from cuda.bindings import driver  # noqa: F401
    except ImportError:
        return "cuda-python not installed"
    return None


def pytest_collection_modifyitems(config, items):
    reason = _gpu_missing()
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


@pytest.fixture(autouse=True)
def _publish_every_from_the_environment(monkeypatch):
    """GPU_TEST_PUBLISH_EVERY=-2 runs every GPU test's swaps with that swap.PUBLISH_EVERY (the
    stores read it when built): one lease checks a publishing mode across the engine's tests
    before it becomes the default. Tests only; the package never reads it (and the launcher refuses
    unknown REAP_* variables, hence the name)."""
    import os

    value = os.environ.get("GPU_TEST_PUBLISH_EVERY")
    if value:
        from reap_swap.engine.residency import swap

        monkeypatch.setattr(swap, "PUBLISH_EVERY", int(value))
