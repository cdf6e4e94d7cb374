"""`--reap-budget auto | GiB`: how device memory is split between weights, KV cache and the expert pool.

Pure arithmetic (no torch, no vLLM): the CUDA shell (engine/residency/budget.py) measures, this decides.

Mechanism (why, in research.md "--reap-budget auto"): the plan's budget is reserved as today at the
first layer's post-load attach, before vLLM profiles memory. With a budget other than "plan" the
worker tells vLLM exactly how many KV bytes it needs (`cache_config.kv_cache_memory_bytes`, from
the model's KV layout and the KV target), so vLLM does not hand all remaining memory to the KV
cache. After the engine is up (weights loaded, KV allocated, CUDA graphs captured) the pool grows
by new HBM slots into what `torch.cuda.mem_get_info` leaves under `--gpu-memory-utilization`,
minus the measured activation peak and a safety margin; expert addresses never change (new slots
are separate allocations mapped into the same per-layer ranges), so captured graphs stay valid.
The new slots are filled from the plan's ranked order (`fillOrder`) through the normal swap path.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

GIB = 2**30
# KV tokens per sequence are rounded up to this many: vLLM 0.26.0 picks the attention backend's block
# size *after* the model loads (Platform.update_block_size_for_backend: 16 by default, 64 for
# FlashMLA, up to 256), and its max-model-len check needs cdiv(max_model_len, block) whole blocks.
KV_TOKEN_ROUND = 256
DEFAULT_MARGIN_BYTES = 512 * 2**20  # left unused under the utilization cap (allocator slack)


class BudgetError(ValueError):
    """The requested split cannot be served; the message carries the numbers."""


def parse_budget(raw: object) -> str | float:
    """'plan' | 'auto' | a positive GiB number (as float). Raises ValueError naming the value."""
    text = str(raw).strip().lower()
    if text in ("plan", "auto"):
        return text
    try:
        gib = float(text.removesuffix("gib"))
    except ValueError:
        raise ValueError(f"expected 'auto', 'plan' or a number of GiB, got {raw!r}") from None
    if not gib > 0 or gib != gib or gib == float("inf"):
        raise ValueError(f"a GiB budget must be a positive finite number, got {raw!r}")
    return gib


# ----------------------------------------------------------------------------- KV layout


@dataclass(frozen=True)
class KvLayout:
    """Bytes of KV cache one token takes on one tensor-parallel rank, over all attention layers."""

    kind: str  # "mha/gqa" | "mla"
    layers: int
    bytes_per_token: int


def kv_layout(cfg: Mapping, dtype_bytes: int, tp_size: int = 1) -> KvLayout:
    """The KV layout of a text config (a HF config as a dict). Raises BudgetError for layouts whose
    KV bytes this function cannot state exactly (hybrid / sliding-window attention)."""
    layers = int(cfg.get("num_hidden_layers") or 0)
    if layers <= 0:
        raise BudgetError("config has no num_hidden_layers: cannot size the KV cache")
    types = cfg.get("layer_types") or ()
    if cfg.get("full_attention_interval") or any(t != "full_attention" for t in types):
        raise BudgetError(
            "hybrid attention (layer_types / full_attention_interval): KV bytes per token are not "
            "a config sum; sized from vLLM's own KV grouping instead (kv_target.py, kv_groups.py)"
        )
    if cfg.get("sliding_window") and cfg.get("use_sliding_window", True) and not cfg.get("kv_lora_rank"):
        raise BudgetError(
            "sliding-window attention: vLLM sizes its KV per window; sized from vLLM's own KV grouping "
            "instead (kv_target.py, kv_groups.py)"
        )
    if cfg.get("kv_lora_rank"):  # MLA (DeepSeek-V2/V3, Kimi): one latent + rope key, not split by TP
        per_layer = int(cfg["kv_lora_rank"]) + int(cfg.get("qk_rope_head_dim") or 0)
        return KvLayout("mla", layers, layers * per_layer * dtype_bytes)
    heads = int(cfg.get("num_attention_heads") or 0)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // max(heads, 1)))
    if kv_heads <= 0 or head_dim <= 0:
        raise BudgetError("config lacks num_key_value_heads / head_dim: cannot size the KV cache")
    per_rank = max(1, kv_heads // max(tp_size, 1))  # vLLM replicates KV heads when tp > kv_heads
    return KvLayout("mha/gqa", layers, layers * 2 * per_rank * head_dim * dtype_bytes)


def kv_bytes_for(layout: KvLayout, tokens_per_seq: int, num_seqs: int, block_size: int) -> int:
    """KV bytes for `num_seqs` sequences of `tokens_per_seq` tokens, in whole blocks per sequence
    (a block of `block_size` rounded up to a multiple of KV_TOKEN_ROUND: see there)."""
    block = -(-max(int(block_size), KV_TOKEN_ROUND) // KV_TOKEN_ROUND) * KV_TOKEN_ROUND
    blocks = -(-int(tokens_per_seq) // block)
    return int(num_seqs) * blocks * block * layout.bytes_per_token


def experts_in_hbm_at_attach(layer_bytes: int, moe_layers: int, offloader_active: bool) -> int:
    """Expert bytes in HBM at the first MoE layer's post-load attach, which the engine moves off
    before vLLM sizes the KV cache (kv_refusal's `leaving`). `layer_bytes`: that layer's w13/w2 on
    the device. With vLLM's weight offloader set (V1, `--cpu-offload-gb`) only that layer is there:
    vLLM moved it in to process its weights, the others wait in pinned host memory (counting every
    layer made "in use at load" negative on the 12-layer kit model: research.md). Without
    one (Model Runner V2 of vLLM 0.26.0, formats loaded into HBM first) every hooked layer is there
    (the served families have one expert shape per model); a layer refused later keeps its experts
    in HBM, which this does not foresee."""
    return int(layer_bytes) * (1 if offloader_active else max(int(moe_layers), 1))


def kv_refusal(
    *, kv_bytes: int, pool_bytes: int, total: int, free: int, utilization: float, source: str,
    bytes_per_token: int | None, max_model_len: int, leaving: int = 0,
) -> str | None:  # fmt: skip
    """At load: None when the KV target and the plan's pool fit under the cap, else the refusal
    with the numbers and the --reap-kv-tokens that would fit (or why none does). `leaving`: HBM in
    use now that the engine frees before vLLM sizes the KV cache (expert weights loaded into HBM
    first, e.g. on Model Runner V2 of vLLM 0.26.0, which creates no weight offloader)."""
    cap, in_use = int(total * utilization), int(total - free - max(int(leaving), 0))
    left = cap - in_use
    moved = (
        f", not counting {gib(leaving)} GiB of experts in HBM that the engine moves off"
        if leaving > 0
        else ""
    )
    if kv_bytes + pool_bytes <= left:
        return None
    hint = "lower --max-model-len, the plan's budget, or raise --gpu-memory-utilization"
    if bytes_per_token:
        fits = (left - pool_bytes) // bytes_per_token // KV_TOKEN_ROUND * KV_TOKEN_ROUND
        if fits >= max_model_len:
            hint = f"pass --reap-kv-tokens {fits} (or lower --max-num-seqs / --max-model-len)"
    return (
        f"KV target ({source}) needs {gib(kv_bytes)} GiB and the plan's pool {gib(pool_bytes)} GiB, "
        f"but only {gib(left)} GiB is left under the cap of {gib(cap)} GiB (--gpu-memory-utilization "
        f"{utilization} of {gib(total)} GiB, {gib(in_use)} GiB in use at load{moved}); {hint}"
    )


def kv_target(max_model_len: int, max_num_seqs: int, kv_tokens: int | None) -> tuple[int, int]:
    """(tokens per sequence, sequences) of the KV target: --reap-kv-tokens as one pool of tokens
    (at least one full-length sequence), else max_model_len x max_num_seqs."""
    if kv_tokens is None:
        return int(max_model_len), int(max_num_seqs)
    if kv_tokens < max_model_len:
        raise BudgetError(
            f"--reap-kv-tokens {kv_tokens} is below --max-model-len {max_model_len}: "
            "vLLM refuses a KV cache that cannot hold one full-length sequence"
        )
    return int(kv_tokens), 1


# ----------------------------------------------------------------------------- the pool at load


def pool_refusal(
    *, what: str, pool_bytes: int, free: int, total: int, device: int, driver_error: str | None = None
) -> str | None:
    """At the first layer's attach: None when the HBM pool of `pool_bytes` fits the device's free
    memory (`free`, the whole device: other processes count), else the refusal with the numbers.
    `driver_error`: the driver refused an allocation although the check passed (fragmentation, a
    neighbour allocating meanwhile): a stock server holding most of the card beside reap-swap once
    left too little, and the pool's cuMemCreate ended the load in a traceback (research.md)."""
    if driver_error is None and pool_bytes <= free:
        return None
    why = (
        f"the CUDA driver refused it ({driver_error}) with {gib(free)} GiB free before the reservation"
        if driver_error
        else f"cuda:{device} has {gib(free)} GiB free of {gib(total)} GiB"
    )
    return (
        f"the HBM pool ({what}) needs {gib(pool_bytes)} GiB but {why} (this process's weights and "
        "any other process on the GPU hold the rest); free the GPU or serve a plan with a smaller "
        "budget (reap-swap plan --budget-gib)"
    )


# ----------------------------------------------------------------------------- the pool's growth


@dataclass(frozen=True)
class Growth:
    """What the pool gets after the engine is up, and every number the decision used."""

    total_bytes: int
    cap_bytes: int  # gpu_memory_utilization x total
    used_bytes: int  # total - free, after the engine is up (weights, KV, graphs, pool core)
    activation_bytes: int  # measured transient peak of a profile forward
    margin_bytes: int
    unit_bytes: int
    slots_before: int
    extra_slots: int
    max_slots: int  # every expert of every pooled layer
    budget: str | float

    @property
    def slots_after(self) -> int:
        return self.slots_before + self.extra_slots

    @property
    def headroom_bytes(self) -> int:
        return self.cap_bytes - self.used_bytes - self.activation_bytes - self.margin_bytes


def plan_growth(
    *,
    total_bytes: int,
    free_bytes: int,
    utilization: float,
    activation_bytes: int,
    unit_bytes: int,
    slots_before: int,
    max_slots: int,
    budget: str | float,
    margin_bytes: int = DEFAULT_MARGIN_BYTES,
) -> Growth:
    """How many HBM slots to add. Raises BudgetError (with the numbers) when the KV target left
    no room for the plan core, or a GiB cap asks for more than the memory allows."""
    cap = int(total_bytes * utilization)
    used = int(total_bytes - free_bytes)
    g = Growth(
        total_bytes, cap, used, int(activation_bytes), int(margin_bytes), int(unit_bytes),
        int(slots_before), 0, int(max_slots), budget,
    )  # fmt: skip
    if g.headroom_bytes < 0:
        raise BudgetError(
            f"over the memory cap: {gib(used)} GiB in use + {gib(activation_bytes)} GiB activations "
            f"+ {gib(margin_bytes)} GiB margin > {gib(cap)} GiB (--gpu-memory-utilization "
            f"{utilization} of {gib(total_bytes)} GiB); lower --reap-kv-tokens / --max-num-seqs / "
            "--max-model-len or raise --gpu-memory-utilization"
        )
    fits = g.headroom_bytes // max(unit_bytes, 1)
    wanted = max(max_slots - slots_before, 0)
    if isinstance(budget, float):
        cap_slots = int(budget * GIB) // max(unit_bytes, 1)
        if cap_slots < slots_before:
            raise BudgetError(
                f"--reap-budget {budget} GiB ({cap_slots} slots of {gib(unit_bytes)} GiB) is below "
                f"the plan's pool of {slots_before} slots"
            )
        wanted = min(wanted, cap_slots - slots_before)
        if wanted > fits:
            raise BudgetError(
                f"--reap-budget {budget} GiB needs {wanted} more slots ({gib(wanted * unit_bytes)} GiB) "
                f"but only {fits} fit ({gib(g.headroom_bytes)} GiB free under the cap: "
                f"{gib(cap)} GiB cap - {gib(used)} GiB used - {gib(activation_bytes)} GiB "
                f"activations - {gib(margin_bytes)} GiB margin)"
            )
    return Growth(**{**g.__dict__, "extra_slots": int(max(min(wanted, fits), 0))})


def gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f}"


def split_line(
    growth: Growth, *, weights_bytes: int, kv_bytes: int, resident: int, experts: int,
    kv_allocated: int | None = None,
) -> str:  # fmt: skip
    """The one startup line with the split."""
    pool = growth.slots_after * growth.unit_bytes
    return (
        f"reap-swap memory split: weights {gib(weights_bytes)} GiB, pool {gib(pool)} GiB "
        f"({growth.slots_after} slots, {resident}/{experts} experts resident), KV {gib(kv_bytes)} GiB"
        f"{kv_allocated_note(kv_bytes, kv_allocated)}, "
        f"activations {gib(growth.activation_bytes)} GiB, margin {gib(growth.margin_bytes)} GiB, "
        f"cap {gib(growth.cap_bytes)} of {gib(growth.total_bytes)} GiB (budget {growth.budget})"
    )


def kv_allocated_note(kv_bytes: int, kv_allocated: int | None) -> str:
    if kv_allocated is None:
        return ""
    same = "=" if int(kv_allocated) == int(kv_bytes) else "!="
    return f" (vLLM allocated {kv_allocated} B {same} {kv_bytes} B computed)"


def accounting_split_line(*, budget: object, pool_bytes: int, kv_bytes: int, kv_allocated: int | None,
                          kv_source: str) -> str:  # fmt: skip
    """The startup line on accounting residency (no HBM pool: the plan's budget is the pool)."""
    return (
        f"reap-swap memory split (accounting residency, no HBM pool): pool = the plan's budget "
        f"{gib(pool_bytes)} GiB, KV {gib(kv_bytes)} GiB{kv_allocated_note(kv_bytes, kv_allocated)} "
        f"for {kv_source} (budget {budget})"
    )


# ----------------------------------------------------------------------------- ranked fill


def fallback_fill_order(
    core: Mapping[int, Iterable[int]], candidates: Mapping[int, Sequence[int]], num_experts: Mapping[int, int]
) -> list[tuple[int, int]]:
    """The fill order of a plan without `fillOrder`: round-robin over layers (lowest index first);
    within a layer its slice experts in catalog order, then every other expert by id. Core excluded."""
    per_layer: dict[int, list[int]] = {}
    for layer in sorted(num_experts):
        seen = set(core.get(layer, ()))
        order = []
        for e in [*candidates.get(layer, ()), *range(num_experts[layer])]:
            if e not in seen:
                seen.add(e)
                order.append(e)
        per_layer[layer] = order
    out: list[tuple[int, int]] = []
    depth = max((len(v) for v in per_layer.values()), default=0)
    for i in range(depth):
        out.extend((layer, order[i]) for layer, order in per_layer.items() if i < len(order))
    return out


def ranked_fill(
    order: Iterable[tuple[int, int]], base: Mapping[int, Iterable[int]], slots: int, layers: Iterable[int]
) -> dict[int, frozenset[int]]:
    """`base` plus the first experts of `order` (not in base, in `layers`) while `slots` allow.
    Only `layers` (the pooled ones) occupy slots; base's other layers are kept as they are."""
    allowed = set(layers)
    out = {layer: set(v) for layer, v in base.items()}
    room = slots - sum(len(v) for layer, v in out.items() if layer in allowed)
    for layer, e in order:
        if room <= 0:
            break
        if layer in allowed and e not in out.setdefault(layer, set()):
            out[layer].add(e)
            room -= 1
    return {layer: frozenset(v) for layer, v in sorted(out.items())}


# ----------------------------------------------------------------------------- at launch


def launch_check(budget: str | float, plan_budget_bytes: int, accounting_reason: str | None) -> str | None:
    """At launch: None, or the sentence refusing the budget (a GiB cap below the plan's pool).
    On accounting residency (the CPU build) budget auto/GiB is inactive: `inactive_note` says so."""
    if isinstance(budget, float) and budget * GIB < plan_budget_bytes and accounting_reason is None:
        return (
            f"--reap-budget {budget} GiB is below the plan's budget of {gib(plan_budget_bytes)} GiB: "
            "the plan's pool is reserved at load; lower the plan's budget instead"
        )
    return None


def inactive_note(budget: str | float, accounting_reason: str | None) -> str | None:
    """Why budget auto/GiB does nothing here (no device memory to split), or None when it applies."""
    if budget == "plan" or accounting_reason is None:
        return None
    return (
        f"--reap-budget {budget}: the pool half is inactive: {accounting_reason} (accounting residency "
        "has no HBM pool to size); the plan's budget is the pool, which swaps keep full from the plan's "
        "fill order. The KV half applies: vLLM's KV cache is sized to the KV target (--reap-kv-tokens, "
        "else max-model-len x max-num-seqs) unless --kv-cache-memory-bytes is given"
    )
