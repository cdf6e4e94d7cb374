#!/usr/bin/env python3
"""Memory and wall-time estimates of the full-depth phases on ONE H200 (branch fulldepth; pure: no
torch, no vLLM, no device). Used to write the runbook in research.md ("fulldepth") and checked by
tests/test_fulldepth_budget.py. Every constant names the run it comes from.

  python3 research/gpu/fulldepth_budget.py            # the table of the runbook (markdown)

Estimates, not measurements: the lead's run replaces them (gpu_families.py records startup, peak
RSS, host in use and HBM per server).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from reap_swap.sizing.host_memory import uva_pinned_bytes  # noqa: E402
from reap_swap.sizing.model_shape import read_model_shape  # noqa: E402

GIB = 2**30
DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
HBM_GIB, HOST_GIB = 139.8, 125.9  # nvidia-smi total (run 10); MemTotal of the lent host (run 10)
HBM_MARGIN_GIB, HOST_MARGIN_GIB = 8.0, 12.0  # run 9: the lane's HBM estimate was too tight (OOM)
OVERHEAD_HBM_GIB = 1.5  # CUDA context, eager activations, allocator slack per server
HOST_BASE_GIB = 3.5  # run 9 depth 2: reap RSS 6.1 / 9.1 GiB for 2.97 / 5.25 GiB of experts
STOCK_HOST_GIB = 4.3  # run 10: stock Qwen3.5 (dummy weights straight to HBM) RSS peak
PAGE = 2 * 2**20  # the engine's HBM slot unit rounds an expert up to 2 MiB pages (run 9: 9 -> 10 MiB)
PIN_GBPS = 0.55  # vLLM's UVA offloader pinning (run 8: 60 GiB in 112 s)
REHOME_GIBPS = 2.07  # the engine's re-home (run 8: 60 GiB in 29 s)
EAGER_START_S = 100.0  # run 9 depth 2, eager: reap 104 / 98 s, stock 106 / 98 s (tiny experts)
GRAPHS_EXTRA_S = 120.0  # run 8: torch.compile 72 s + graph capture / warm-up 49 s
MISS_GBPS = 33.0  # run 9 Mixtral depth 2: (1/20.5 - 1/163.4) s per 2 layers x 672 MiB

# Dense (non-expert) weights, GiB: public total parameter counts x 2 bytes minus the routed experts
# (Mixtral-8x7B 46.7 B, gpt-oss-20b 20.9 B, DeepSeek-V2-Lite 15.7 B); Qwen3.5 measured (run 8:
# "Model loading took 4.69 GiB"); DeepSeek-V3 depth 2 summed by hand (embedding + LM head 3.45,
# MLA 2 x 0.35, dense MLP 0.74, shared expert 0.08); Kimi-K2 depth 3 likewise (embedding + LM head
# 2 x 163840 x 7168 x 2 B = 4.38, MLA with 64 heads 3 x 0.19, dense MLP 0.74, 2 shared experts 0.16).
DENSE_GIB = {"mixtral_8x7b": 2.98, "gpt_oss_20b": 3.33, "deepseek_v2_lite": 2.43, "deepseek_v3_d2": 4.97,
             "qwen35": 4.69, "kimi_k2_d3": 5.85}  # fmt: skip
CONFIGS = {
    "mixtral_8x7b": "mixtral_8x7b_config.json", "gpt_oss_20b": "gpt_oss_20b_bf16_config.json",
    "deepseek_v2_lite": "deepseek_v2_lite_config.json", "deepseek_v3_d2": "deepseek_v3_bf16_depth2_config.json",
    "qwen35": "qwen3_5_moe_35b_a3b_config.json", "kimi_k2_d3": "kimi_k2_bf16_depth3_config.json",
}  # fmt: skip


@dataclass(frozen=True)
class Family:
    name: str
    moe_layers: int
    experts: int
    top_k: int
    expert_bytes: int
    dense_gib: float

    @property
    def expert_gib(self) -> float:
        return self.moe_layers * self.experts * self.expert_bytes / GIB

    @property
    def unit_bytes(self) -> int:
        return -(-self.expert_bytes // PAGE) * PAGE


def family(name: str) -> Family:
    s = read_model_shape(DATA / CONFIGS[name])
    return Family(name, len(s.moe_layers), s.num_experts, s.top_k, s.expert_bytes, DENSE_GIB[name])


def reap_memory(f: Family, pool_share: float = 1.0, kv_gib: float = 0.5) -> tuple[float, float]:
    """(HBM, host) GiB of a reap-swap server whose pool holds pool_share of the experts."""
    pool = f.moe_layers * round(f.experts * pool_share) * f.unit_bytes / GIB
    layer = f.experts * f.expert_bytes / GIB  # one layer held twice while it is re-homed
    return pool + f.dense_gib + kv_gib + OVERHEAD_HBM_GIB, f.expert_gib + layer + HOST_BASE_GIB


# families vLLM 0.26.0 runs on Model Runner V2, which sets no UVA offloader: nothing is pinned through
# PyTorch, the experts load into HBM and move to the engine's exact host range (run 13: RSS 3.17 GiB)
NO_UVA = {"deepseek_v2_lite"}


def pinned_host_gib(f: Family) -> float:
    """Host in use by a reap-swap server at its first re-home, counting what PyTorch's caching host
    allocator really pins (reap_swap.sizing.host_memory.uva_pinned_bytes: each layer's w13 and w2 rounded up
    to a power of two; torch 2.11 has no setting against it, research-notes/pinned-round): all layers
    are pinned before the engine re-homes the first one into its own exact range. Reproduces run 13's
    Mixtral-8x7B (2 + 1 GiB for 1.75 + 0.875 GiB: 96 GiB pinned for 84; 102.1 vs 102.05 GiB in use
    above the host's idle) and run 8's Qwen3.5 (powers of two already: 65.0 vs 65.4)."""
    layer = f.experts * f.expert_bytes
    w13 = f.expert_bytes * 2 // 3  # gated bf16 experts: gate + up, then down
    return (
        uva_pinned_bytes(w13, f.expert_bytes - w13, f.experts, f.moe_layers) + layer
    ) / GIB + HOST_BASE_GIB


def stock_memory(f: Family, kv_gib: float = 0.5) -> tuple[float, float]:
    return f.expert_gib + f.dense_gib + kv_gib + OVERHEAD_HBM_GIB, STOCK_HOST_GIB


def fits(servers: list[tuple[float, float]]) -> dict:
    hbm, host = sum(s[0] for s in servers), sum(s[1] for s in servers)
    return {
        "hbm": hbm,
        "host": host,
        "ok": hbm <= HBM_GIB - HBM_MARGIN_GIB and host <= HOST_GIB - HOST_MARGIN_GIB,
    }


def startup_s(f: Family, reap: bool, graphs: bool = False) -> float:
    t = EAGER_START_S + (GRAPHS_EXTRA_S if graphs else 0.0)
    if reap:
        t += f.expert_gib * GIB / 1e9 / PIN_GBPS + f.expert_gib / REHOME_GIBPS
    return t


def points_s(f: Family, prompts: int, greedy: int, decode: int, shares=(0, 0.25, 0.5, 1, 0)) -> float:
    """The residency points' wall time: every decoded token at share r reads (1 - r) of its top-k
    experts over PCIe (dummy weights route without structure: h ~ r), plus ~10 s per point
    (prefills, the MoE probe, the swap)."""
    t_miss = f.top_k * f.moe_layers * f.expert_bytes / 1e9 / MISS_GBPS
    tokens = prompts * greedy + decode + 16  # + decode_speed's warm-up
    return sum((1 - r) * t_miss * tokens + 10.0 for r in shares)


def rows() -> list[str]:
    out = ["| family | experts GiB | reap HBM / host GiB | reap host, pinned rounding | stock HBM / host | pair fits | "
           "reap start s | points s |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    knobs = {"mixtral_8x7b": (4, 16, 16), "gpt_oss_20b": (8, 16, 64), "deepseek_v2_lite": (8, 16, 64),
             "deepseek_v3_d2": (8, 16, 64), "kimi_k2_d3": (4, 16, 32)}  # fmt: skip
    for name, (p, g, d) in knobs.items():
        f = family(name)
        r, s = reap_memory(f), stock_memory(f)
        pair = fits([r, s])
        pinned = "n/a (no UVA)" if name in NO_UVA else f"{pinned_host_gib(f):.1f}"
        out.append(
            f"| {name} | {f.expert_gib:.1f} | {r[0]:.1f} / {r[1]:.1f} | {pinned} | {s[0]:.1f} / {s[1]:.1f} | "
            f"{'yes' if pair['ok'] else 'no'} ({pair['hbm']:.0f} HBM, {pair['host']:.0f} host) | "
            f"{startup_s(f, True):.0f} | {points_s(f, p, g, d):.0f} |"
        )
    return out


if __name__ == "__main__":
    print("\n".join(rows()))
