"""How a checkpoint's quantization reaches the launcher, and how a plan's budget becomes pool slots.

Why: the launcher changes vLLM's arguments (``--moe-backend triton``, every expert loaded into
pinned host memory through UVA offload) only for layers the residency engine can re-home. For a
format the engine refuses on every layer, those changes would break stock vLLM (0.26.0 raises on
``--moe-backend triton`` for the INT4 WNA16 methods: ``map_wna16_backend`` knows only marlin,
humming, flashinfer_trtllm and emulation) or slow it down for nothing (experts left in host
memory behind a refused layer). So for those formats the launcher leaves vLLM's arguments alone:
the server comes up on vLLM's stock path with every expert in HBM, and the engine records each
layer's refusal in ``/reap/status``.

**Budget → slots (the rule).** A plan budgets *experts*: its bytes are counted in
``per_expert_bytes``, which validation pins to the checkpoint's expert bytes as the config stores
them (``ModelShape.expert_bytes``: bf16 3·H·I·2, FP8 3·H·I, INT4/MXFP4 3·H·I/2). The engine's
pool gets ``swappable_budget_bytes // per_expert_bytes`` slots, each one mapping unit of the
*served* format (the expert's re-homed payload padded to the 2 MiB granularity), so its HBM is
``slots × unit_bytes``. The number of resident experts is therefore what the plan chose, whatever
the served precision: a plan made on a bf16 checkpoint (9 MiB experts at Qwen3-30B-A3B shape)
served with online ``--quantization fp8`` (the config is still bf16, so the plan validates) gets
the same slot count, and the pool takes 6 MiB per slot instead of 10 MiB. The HBM a plan names is
an upper bound then, never exceeded; the KV cache gets the rest. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from reap_swap.sizing.quant.scheme import QuantScheme, scheme_from_config

# vLLM `--quantization` values that pick a method the engine refuses, whatever the checkpoint
# (0.26.0: MoeWNA16Method; the Marlin names route AWQ/GPTQ to MarlinExperts).
REFUSED_CLI_METHODS = frozenset({"moe_wna16", "awq_marlin", "gptq_marlin", "marlin", "mxfp4"})
# The expert weights as the unquantized and FP8 methods register them: what the launcher names to
# vLLM's UVA offloader (`--cpu-offload-params`) unless a format registers others (INT4 below).
UNQUANTIZED_OFFLOAD_PARAMS = ("w13_weight", "w2_weight")


@dataclass(frozen=True)
class ServedQuant:
    """A checkpoint's quantization as the launcher sees it, before vLLM loads anything."""

    method: str  # the HF quant_method ("" for none), or the --quantization value when it overrides
    scheme: QuantScheme
    engine_refusal: str | None  # why the engine will refuse every MoE layer; None: it binds them
    # why vLLM's UVA offloader must not be asked to load the experts into host memory (None: it may)
    uva_refusal: str | None = None
    triton: bool = True  # whether the launcher sets --moe-backend triton (INT4: Marlin stays)
    # the parameter names the launcher asks vLLM's UVA offloader to load into pinned host memory
    offload_params: tuple[str, ...] = UNQUANTIZED_OFFLOAD_PARAMS

    @property
    def launcher_may_offload(self) -> bool:
        """Whether the launcher may set --moe-backend triton and the UVA expert offload."""
        return self.engine_refusal is None


# vLLM 0.26.0 online quantization creates the weights on the meta device (`uses_meta_device`) and
# materializes them layer by layer while loading; its UVA offloader copies every chosen parameter
# to host memory when the layer is built, and a meta tensor has no data ("Cannot copy out of
# meta tensor"). So the experts load into HBM, one layer at a time, and the engine moves each
# layer into its host-backed range right after that layer is quantized.
ONLINE_UVA_REFUSAL = (
    "online --quantization fp8: vLLM creates the weights on the meta device and its UVA offloader "
    "cannot copy them at model construction; experts load into HBM layer by layer and the engine "
    "re-homes each layer after it is quantized"
)


# INT4 W4A16 with --reap-group-size not 1 (research.md int4grp, int4perm): the engine binds Marlin
# and moe_wna16 layers in identity-order contiguous groups of whole pages (consecutive expert ids:
# the kernel sees stock's ids; served identical to stock on the H200; the permuted order was not
# bitwise on Marlin, and is never used for INT4). vLLM's default WNA16 backend (Marlin) stays
# (0.26.0 raises on --moe-backend triton for it). The experts still load into pinned host memory
# through vLLM's UVA offload, under the names the INT4 methods register (INT4_OFFLOAD_PARAMS): vLLM's
# device_loading_context runs the Marlin repack of one layer at a time (reading the host copy, writing
# HBM), the engine re-homes that layer into host-backed groups right after, so only one layer's
# repacked weights are ever in HBM at load.
# The packed INT4 weights as each method registers them (vLLM 0.26.0: AutoAWQMoEMethod,
# AutoGPTQMoEMethod and MoeWNA16Method `w13_qweight`; compressed-tensors' WNA16 `w13_weight_packed`).
# Scales, zeros and g_idx stay in HBM (a few % of the bytes; the engine keeps or groups them).
INT4_OFFLOAD_PARAMS = {
    "compressed-tensors": ("w13_weight_packed", "w2_weight_packed"),
    "": ("w13_qweight", "w2_qweight"),  # awq, gptq, moe_wna16 and any other INT4 method
}
GROUPED_INT4_CLI = frozenset({"moe_wna16"})


def _grouped_int4(scheme: QuantScheme, method: str, cli: str, group_size: str) -> ServedQuant | None:
    if group_size == "1" or scheme.kind != "int" or scheme.bits != 4 or cli not in ("", *GROUPED_INT4_CLI):
        return None
    names = INT4_OFFLOAD_PARAMS.get(cli or method, INT4_OFFLOAD_PARAMS[""])
    return ServedQuant(cli or method, scheme, None, None, triton=False, offload_params=names)


def _refusal(method: str, scheme: QuantScheme) -> str | None:
    if scheme.kind == "int":
        return (
            f"{method}: INT{scheme.bits} weight-only experts run on Marlin or moe_wna16, kernels that "
            "read expert e at e x payload (contiguous); only contiguous groups bind them "
            "(--reap-group-size auto)"
        )
    if scheme.kind == "mxfp4":
        return (
            f"{method}: MXFP4 experts run on triton_kernels' monolithic OAI kernel (swizzled, routing "
            "inside the kernel) or Marlin (contiguous); the engine binds neither"
        )
    if scheme.kind == "unknown":
        return f"{method}: quantization method unknown to the engine"
    return None


def served_quant(
    scheme: QuantScheme,
    method: str = "",
    cli_quantization: str | None = None,
    group_size: str = "1",
    oai_mxfp4: bool = False,
) -> ServedQuant:
    """The checkpoint's scheme (``ModelShape.quant``), its ``quant_method``, ``--quantization`` and
    ``--reap-group-size`` (INT4 binds only in contiguous groups, identity order: research.md
    int4perm). ``oai_mxfp4``: a GPT-OSS MXFP4 checkpoint with the engine's MXFP4 path on
    (compat/mxfp4.py): served on vLLM's Triton backend, per expert, the checkpoint's weights loaded
    into pinned host memory (vLLM swizzles one layer at a time in HBM, the engine re-homes it)."""
    cli = (cli_quantization or "").lower()
    if oai_mxfp4 and scheme.kind == "mxfp4" and not cli and str(group_size) == "1":
        return ServedQuant(method or "mxfp4", scheme, None)
    grouped = _grouped_int4(scheme, method, cli, str(group_size))
    if grouped is not None:
        return grouped
    if cli in REFUSED_CLI_METHODS:
        why = f"--quantization {cli}: a method the engine refuses ({_refusal(cli, scheme) or 'not bound'})"
        return ServedQuant(cli, scheme, why)
    if cli == "fp8" and scheme.kind == "unquantized":  # online fp8 of a bf16 checkpoint: bound
        return ServedQuant("fp8 (online)", QuantScheme("fp8", 8, "tensor"), None, ONLINE_UVA_REFUSAL)
    return ServedQuant(method, scheme, _refusal(method or "unquantized", scheme))


def served_quant_of(
    quant_config: Mapping[str, Any] | None,
    cli_quantization: str | None = None,
    group_size: str = "1",
    oai_mxfp4: bool = False,
) -> ServedQuant:
    """As `served_quant`, from an HF ``quantization_config`` (or None)."""
    method = str((quant_config or {}).get("quant_method", "")).lower()
    return served_quant(scheme_from_config(quant_config), method, cli_quantization, group_size, oai_mxfp4)


def device_load_refusal(
    expert_bytes: int, tensor_parallel: int, utilization: float, device_total: int | None, why: str
) -> str | None:
    """Where the experts load into HBM before the engine re-homes them (`ServedQuant.uva_refusal`:
    online FP8), a refusal before loading when each GPU's share of them alone is
    over vLLM's memory cap (utilization x total); None when it fits or the total is unknown."""
    if not device_total:
        return None
    per_gpu = expert_bytes / max(1, tensor_parallel)
    cap = utilization * device_total
    if per_gpu <= cap:
        return None
    return (
        f"{why}: this model's experts alone take {per_gpu / 2**30:.1f} GiB per GPU (TP={tensor_parallel}), "
        f"over --gpu-memory-utilization {utilization:g} x {device_total / 2**30:.1f} GiB = {cap / 2**30:.1f} "
        "GiB, so loading would run out of memory; raise --tensor-parallel-size, or serve a format the "
        "launcher loads into pinned host memory (bf16, FP8 checkpoints)"
    )


def hbm_first_load_refusal(
    expert_bytes: int, pool_bytes: int, tensor_parallel: int, device_total: int | None, why: str
) -> str | None:
    """Model Runner V2 of vLLM 0.26.0 creates no weight offloader (compat/runner.py): every expert is in
    HBM when the engine's first attach reserves the plan's pool, so each GPU's load peak is its share
    of the experts plus of the pool (plus the dense weights, not counted here; DeepSeek-V2-Lite's
    load peak is that sum: research.md). `--gpu-memory-utilization` caps no load (the engine frees the
    experts before vLLM sizes the KV cache), the device does: a refusal when the sum is over its
    memory; None when it fits or the total is unknown."""
    if not device_total:
        return None
    tp = max(1, int(tensor_parallel))
    per_gpu = (int(expert_bytes) + max(int(pool_bytes), 0)) / tp
    if per_gpu <= device_total:
        return None
    return (
        f"{why}: while loading, each GPU holds its share of every expert ({expert_bytes / tp / 2**30:.1f} GiB, "
        f"TP={tp}) and of the plan's HBM pool ({max(pool_bytes, 0) / tp / 2**30:.1f} GiB), "
        f"{per_gpu / 2**30:.1f} GiB, over the device's {device_total / 2**30:.1f} GiB; raise "
        "--tensor-parallel-size or lower the plan's budget"
    )


def pool_slots(swappable_budget_bytes: int, per_expert_bytes: int) -> int:
    """Slots of the engine's HBM pool: the number of experts the plan's budget holds (module doc)."""
    if per_expert_bytes < 1:
        raise ValueError(f"per_expert_bytes must be positive (got {per_expert_bytes})")
    return max(int(swappable_budget_bytes), 0) // int(per_expert_bytes)


def pool_hbm_bytes(slots: int, unit_bytes: int) -> int:
    """HBM the pool reserves: one served-format mapping unit per slot."""
    return int(slots) * int(unit_bytes)
