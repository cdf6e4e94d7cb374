"""`--reap-budget auto | GiB`: how device memory is split between weights, KV cache and the expert pool.

Pure arithmetic (no torch, no vLLM): the CUDA shell (residency/budget.py) measures, this decides.

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
from typing import Any

from reap_swap.quant_budget import pool_slots

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


def slots_beyond_pinned(num_slots: int, pinned: Mapping[int, Iterable[int]]) -> int:
    """Pool slots not taken by the pinned set (core + active set): what a device cache may use
    (`--reap-cache-slots auto`)."""
    return max(int(num_slots) - sum(len(set(v)) for v in pinned.values()), 0)


def pinned_tail_split(
    pool_slots: int, num_layers: int, pinned: Mapping[int, Iterable[int]], setting: int | str
) -> tuple[int, str | None]:
    """(cache tail slots per layer, why the cache cannot engage or None): the device cache's pinned
    form (``core+dlfu``, device_cache_engine.CacheConfig.split) and accounting mode's same policy
    (cache_accounting) share this rule. ``setting``: --reap-cache-slots, ``auto`` (the pool's slots
    beyond the pinned set, evenly per layer) or N (N // layers each); remainders are not lent. Refused:
    fewer than one slot per layer, more than the pool, or a lending that leaves the swap table
    (swap_slots_after_lending) fewer slots than the pinned set (CUDA pins it there at load)."""
    layers = max(int(num_layers), 1)
    if setting == "auto":
        beyond = slots_beyond_pinned(pool_slots, pinned)
        per_layer = beyond // layers
        if per_layer <= 0:  # e.g. every expert pinned: no tail, no cost
            return 0, (
                f"--reap-cache-slots auto: {beyond} pool slot(s) beyond the pinned set, fewer than one "
                f"per layer ({num_layers} layers, pool {pool_slots})"
            )
        return per_layer, None
    per_layer = int(setting) // layers
    if per_layer <= 0:
        return 0, "--reap-cache-slots is 0" if int(setting) <= 0 else (
            f"--reap-cache-slots {setting} < one per layer ({num_layers} layers)"
        )
    if per_layer * num_layers > pool_slots:
        return per_layer, (
            f"{num_layers} layers x {per_layer} cache slots = {per_layer * num_layers} > the pool's {pool_slots}"
        )
    held = sum(len(set(v)) for v in pinned.values())
    if held + per_layer * num_layers > pool_slots:  # the swap table could not hold the pinned set
        return per_layer, (
            f"{num_layers} layers x {per_layer} cache slots = {per_layer * num_layers} leave "
            f"{pool_slots - per_layer * num_layers} of the pool's {pool_slots} for swaps, fewer than the "
            f"pinned set's {held}"
        )
    return per_layer, None


SMALL_TAIL_TOP_K = 2  # the pinned form wants >= 2 x top_k tail slots per layer (research.md "cachetail")


def small_tail_note(
    per_layer: int, top_k: int, pool_slots: int, pinned_slots: int, num_layers: int
) -> str | None:
    """The sentence for the log and /reap/status ``cache.tail_note`` when the pinned form
    (core+dlfu, device and accounting alike) engages with fewer than 2 x top_k tail slots per layer;
    None when the tail is large enough, or when there is no tail (that is a refusal, said apart)."""
    want = SMALL_TAIL_TOP_K * int(top_k)
    if per_layer <= 0 or top_k <= 0 or per_layer >= want:
        return None
    return (
        f"core+dlfu cache tail of {per_layer} slot(s) per layer is below 2 x top_k = {want} (top_k "
        f"{top_k}; pool {pool_slots} slots, {pinned_slots} of them the pinned plan core, {num_layers} "
        "layers): with so few tail slots the cache thrashes; in simulation at 12.5 % of expert bytes such "
        "plans had 6-12 points less expert hit rate (more host reads) than the same cache on a core capped "
        "for a 2 x top_k tail (research.md 'cachetail'). Remedy: re-plan with `reap-swap plan --cache-tail auto` (each "
        "layer's core capped to leave 2 x top_k tail slots; at small budgets the core may become small "
        "or empty, a layout NOT yet verified on a GPU), or a larger budget (a plan with a larger "
        "--budget-ratio/--budget-gib; a larger --reap-budget where it may grow the pool, not with "
        "--reap-cache-device on)"
    )


def swap_slots_after_lending(pool_slots: int, num_layers: int, per_layer: int, refusal: str | None) -> int:
    """K, the pool slots the swap table keeps in the pinned form: the pool less the lent tail
    (layers x per_layer), or the whole pool when the cache is refused (nothing lent). CacheConfig.split
    returns it on CUDA; accounting mode refuses a swap wider than it, as the CUDA table does."""
    return int(pool_slots) if refusal else int(pool_slots) - int(per_layer) * int(num_layers)


def swap_table_refusal(
    needed: int, swap_slots: int, lent: int, layers: int, per_layer: int | None = None
) -> str:
    """The refusal of a resident set wider than the swap table beside lent cache tails: one sentence
    for CUDA's SlotTable.plan and accounting mode's check_swap (both raise PoolCapacityError with
    it). ``swap_slots``: K; ``lent``: the pool slots lent to the cache tails (the pool is K + lent);
    ``layers`` / ``per_layer``: the lending, ``layers x per_layer = lent`` in the pinned form
    (swap_slots_after_lending); ``per_layer`` None where the layers lend different counts (the
    seeded device's C_l)."""
    split = f"{layers} layers x {per_layer} = {lent}" if layers and per_layer is not None else f"{lent}"
    over = f" of {layers} layers" if layers and per_layer is None else ""
    # The remedies that make this set fit, whatever the setting (a server already at `swaps` was once
    # told to pass `swaps`). Pinned: N // layers a layer is lent, so N <= lent - overflow fits; below
    # one slot a layer the cache is refused and the whole pool swaps. Seeded: C_l = core + N spread.
    overflow = needed - swap_slots
    fit = lent - overflow
    if per_layer is None:
        lend = f"lend {overflow} fewer (--reap-cache-slots N lower by {overflow} or more)"
    elif layers and fit < layers:
        lend = "serve without the cache (--reap-cache off: it lends at least one slot a layer)"
    else:
        lend = f"lend at most {fit} (--reap-cache-slots N <= {fit})"
    return (
        f"resident set needs {needed} expert slots but the swap table has {swap_slots} (overflow "
        f"{overflow} experts): the HBM pool of {swap_slots + lent} slots less {split} lent to the cache "
        f"tails{over}; ask for at most {swap_slots} experts, {lend}, or serve a plan with a larger budget"
    )


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


def swap_cache_split(
    pool_slots: int, core_slots: int, num_layers: int, top_k: int
) -> tuple[int, int, str | None]:
    """(tail slots per layer, K the swap table keeps, why not) for the cache *and* per-request swaps
    in the pinned form (the bench's ``plan-swap+cache``). With ``--reap-cache-slots auto`` the tail
    takes every slot beyond the core, so K = the core and no swap beyond it fits (research.md
    "acctail"); this split leaves the swaps half of what lies beyond the core, with the tail at most
    2 x top_k per layer (SMALL_TAIL_TOP_K, research.md "cachetail")."""
    layers = max(int(num_layers), 1)
    beyond = (int(pool_slots) - int(core_slots)) // layers
    per_layer = min(SMALL_TAIL_TOP_K * int(top_k), beyond // 2)
    if per_layer < 1:
        return (
            0,
            int(pool_slots),
            (
                f"the pool's {pool_slots} slots leave {beyond} per layer beyond the plan core ({core_slots} "
                f"experts, {num_layers} layers): too few to split between a cache tail and per-request swaps"
            ),
        )
    return per_layer, int(pool_slots) - per_layer * layers, None


@dataclass(frozen=True)
class PlanSwapSplit:
    """swap_cache_split on a plan's pool: what ``--reap-cache-slots swaps`` serves and the bench's
    ``plan-swap+cache`` arm passes (``cache_slots`` = layers x per_layer; per-request swaps fit K)."""

    pool: int  # the engine's pool slots (quant_budget.pool_slots of the budget)
    core: int  # the plan core's slots
    layers: int
    per_layer: int  # cache tail slots per layer
    kept: int  # K, the swap table the lending leaves
    why: str | None  # no room for both (per_layer 0, kept = pool)

    @property
    def cache_slots(self) -> int:
        return self.per_layer * self.layers


def plan_swap_split(plan: Any, top_k: int, budget_bytes: int | None = None) -> PlanSwapSplit:
    """The split of ``plan``'s pool (its budget, or ``budget_bytes``) as engine._ensure_pool sizes it."""
    per_expert = int(plan.per_expert_bytes)
    budget = int(plan.swappable_budget_bytes) if budget_bytes is None else int(budget_bytes)
    pool = pool_slots(budget, per_expert)
    core = int(plan.core_bytes()) // per_expert  # the plan core's slots (the swap table pins it)
    per_layer, kept, why = swap_cache_split(pool, core, len(plan.layers), int(top_k))
    return PlanSwapSplit(pool, core, len(plan.layers), per_layer, kept, why)
