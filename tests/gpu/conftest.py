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
