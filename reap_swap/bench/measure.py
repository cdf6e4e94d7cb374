"""Measuring one arm on its running server: warm-up, greedy outputs per prompt, streamed timings, swaps."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import httpx

from reap_swap.bench import server_driver as serving
from reap_swap.bench.arms import RunSpec
from reap_swap.bench.config import BenchConfig


def served_model_id(url: str, headers: Mapping[str, str]) -> str:
    r = httpx.get(url + "/v1/models", headers=headers, timeout=60)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _join_prompts(prompts: Sequence[Mapping]) -> list[dict]:
    """One user message with every prompt's text: what a batch's single active set is chosen for."""
    from reap_swap.client.selection import prompt_text

    return [{"role": "user", "content": "\n\n".join(prompt_text(p["messages"]) for p in prompts)}]


def _miss_totals(misses: Mapping) -> dict:
    t = misses.get("totals") or {}
    return {
        k: t.get(k) for k in ("observed_selections", "missed_selections", "observed_mass", "inactive_mass")
    }


def _swap_record(rid: str, kind: str, summary: Mapping, client_ms: float | None = None) -> dict:
    return {
        "request_id": rid,
        "kind": kind,
        "noop": summary.get("noop"),
        "bytes_copied": summary.get("bytes_copied"),
        "server_seconds": summary.get("server_seconds"),
        "client_ms": client_ms if client_ms is not None else summary.get("client_ms"),
        "signature": summary.get("signature"),
        "mode": summary.get("mode"),
    }


def arm_strategy(cfg: BenchConfig, arm: str) -> str:
    """plan-static and plan-cache are plain clients (the 'static' selection: the core, no set
    changes; plan-cache's cache adapts on its own); plan-swap(+cache) use --strategy."""
    return "static" if arm in ("plan-static", "plan-cache") else cfg.strategy


class ArmRunner:
    """Measures one started server; ``client`` is a ReapClient for the reap arms, else None."""

    def __init__(
        self,
        cfg: BenchConfig,
        spec: RunSpec,
        url: str,
        headers: Mapping[str, str],
        model: str,
        prompts: list[dict],
        top_k: int,
        tick,
        client=None,
    ):
        self.cfg, self.spec, self.url, self.headers, self.model = cfg, spec, url, dict(headers), model
        self.prompts, self.top_k, self.tick, self.client = prompts, top_k, tick, client
        self.swaps: list[dict] = []

    @property
    def strategy(self) -> str:
        return arm_strategy(self.cfg, self.spec.arm)

    def _body(self, messages, max_tokens: int, **extra) -> dict:
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            **extra,
        }

    def warm_up(self) -> None:
        """One streamed request, discarded (compiles/allocates what the first request would)."""
        body = self._body(self.prompts[0]["messages"], min(16, self.cfg.decode_tokens), ignore_eos=True)

        serving.stream_all(self.url, "/v1/chat/completions", [body], self.headers)
        self.tick()

    # -- greedy outputs + hit rates ----------------------------------------------------------
    def greedy(self) -> tuple[list[dict], list[dict]]:
        outputs, requests = [], []
        for p in self.prompts:
            rid = f"bench-{self.spec.label}-g{p['index']}"
            if self.client is None:
                r = httpx.post(
                    self.url + "/v1/chat/completions",
                    headers=self.headers,
                    timeout=600,
                    json=self._body(p["messages"], self.cfg.max_tokens, logprobs=True),
                )
                r.raise_for_status()
                outputs.append(serving.chat_greedy_record(r.json()))
            else:
                refresh = self.cfg.refresh_every if self.spec.arm.startswith("plan-swap") else None
                res = self.client.chat(
                    p["messages"],
                    strategy=self.strategy,
                    request_id=rid,
                    budget_bytes=self.spec.client_budget_bytes,
                    refresh_every=refresh,
                    max_tokens=self.cfg.max_tokens,
                    temperature=0.0,
                    logprobs=True,
                )
                rec = serving.chat_greedy_record(res.completion)
                outputs.append(rec)
                kind = "warm" if str(res.swap.get("opened_with", "")).startswith("warm") else "swap"
                self.swaps.append(_swap_record(rid, kind, res.swap))
                for ref in res.refreshes:
                    if ref.get("swap"):
                        self.swaps.append(_swap_record(rid, "refresh", ref["swap"]))
                requests.append(self._request_row(rid, res, rec))
            self.tick()
        return outputs, requests

    def _request_row(self, rid: str, res, rec: Mapping) -> dict:
        usage = rec.get("usage") or res.completion.get("usage") or {}
        routed_tokens = (usage.get("prompt_tokens") or 0) + (usage.get("completion_tokens") or 0) - 1
        layers = (res.router_misses or {}).get("layers") or {}
        expected = routed_tokens * self.top_k
        return {
            "request_id": rid,
            **_miss_totals(res.router_misses),
            "hit_rate": res.hit_rate,
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"),
            "selection": {
                k: v
                for k, v in res.selection.to_dict().items()
                if k in ("strategy", "signature", "resident_bytes", "budget_bytes", "slices")
            },
            "probe": res.probe,
            "refreshes": res.refreshes,
            "timings_ms": res.timings_ms,
            # each layer routes (prompt + completion - 1) x top_k selections (the last token is never fed back)
            "counter_check": {
                "expected_per_layer": expected,
                "ok": all(v.get("observed_selections") == expected for v in layers.values()),
            },
            "router_misses": res.router_misses,
        }

    # -- timing ------------------------------------------------------------------------------
    def _open(self, messages, rid: str) -> float | None:
        """Select and open ``rid`` (swap, or warm when already resident); seconds it took on the client."""
        if self.client is None:
            return None
        t0 = time.perf_counter()
        selection, _probe = self.client.select(
            messages,
            strategy=self.strategy,
            budget_bytes=self.spec.client_budget_bytes,
            request_id=rid,
            model=self.model,
            max_tokens=self.cfg.decode_tokens,
        )
        summary = self.client.open(selection, rid)
        elapsed = time.perf_counter() - t0
        self.swaps.append(
            _swap_record(rid, "warm" if summary["opened_with"].startswith("warm") else "swap", summary)
        )
        return elapsed

    def _misses(self, rid: str) -> dict | None:
        return self.client.router_misses(rid) if self.client is not None else None

    def timing(self) -> dict:
        single, batch = [], []
        n = len(self.prompts)
        body_extra = {
            "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        for rep in range(self.cfg.repeats):
            p = self.prompts[rep % n]
            rid = f"bench-{self.spec.label}-s{rep}"
            open_s = self._open(p["messages"], rid)
            body = self._body(p["messages"], self.cfg.decode_tokens, **body_extra)

            res = serving.stream_all(self.url, "/v1/chat/completions", [body], self.headers)[0]
            misses = self._misses(rid)
            single.append(
                {
                    "request_id": rid,
                    "prompt": p["index"],
                    "open_s": open_s,
                    **res.to_dict(),
                    "misses": _miss_totals(misses) if misses else None,
                }
            )
            self.tick()

            group = [self.prompts[(rep + j) % n] for j in range(self.cfg.batch)]
            rid = f"bench-{self.spec.label}-b{rep}"
            open_s = self._open(_join_prompts(group), rid)
            bodies = [self._body(q["messages"], self.cfg.decode_tokens, **body_extra) for q in group]

            results = serving.stream_all(self.url, "/v1/chat/completions", bodies, self.headers)
            ttfts = sorted(r.ttft_s for r in results if r.ttft_s is not None)
            misses = self._misses(rid)
            batch.append(
                {
                    "request_id": rid,
                    "prompts": [q["index"] for q in group],
                    "open_s": open_s,
                    "decode_tok_s": serving.batch_decode_tok_s(results),
                    "ttft_median_s": ttfts[len(ttfts) // 2] if ttfts else None,
                    "streams": [r.to_dict() for r in results],
                    "misses": _miss_totals(misses) if misses else None,
                }
            )
            self.tick()
        return {"single": single, "batch": batch}
