"""The REAP HTTP endpoints, added to vLLM's OpenAI server as a `vllm.endpoint_plugins` plugin.

Why a plugin: vLLM discovers it in every API process (also the extra ones of
--api-server-count), after its own routers, with no patching. It loads only when VLLM_PLUGINS
names it; `python -m reap_swap.server` sets that. `init_state` builds the SwapController,
adopts the workers' resident set and clears the counts left by warm-up and profiling runs.

Auth: vLLM's --api-key middleware guards only /v1, /v2, /inference (and /cohere): every REAP
route checks the same keys itself.

Errors (JSON {"error": {"message", "type", "field", "code"}}; the message names the field):
  400 invalid_json          body is not JSON
  401 unauthorized          --api-key set and the bearer token is missing or wrong
  404 not_found             unknown request id / cartridge
  422 invalid_request       wrong types, missing or unknown fields
  422 invalid_active_set    unknown layer, out-of-plan expert, unknown sliceId
  422 budget_exceeded       keep-set larger than the budget
  422 capacity_exceeded     keep-set wider than the workers' swap capacity (the slots the device
                            cache's tails leave, a seeded layer's slots, the pool in groups): refused
                            before anything moved (needed, capacity, failed_ranks)
  429 refresh_limit         decode_refresh beyond the plan's max_refreshes_per_request
  500 worker_failed         a worker call failed; the previous resident set was restored on every
                            worker (rolled_back, failed_ranks, each rank's signature in workers)
  503 not_configured        plugin loaded without the reap-swap launcher's configuration
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
from typing import Any, Literal

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import Counter, Histogram
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, TypeAdapter, ValidationError

from reap_swap import get_logger
from reap_swap.compat.serve import engine_client_rpc, engine_client_vllm_config
from reap_swap.config.settings import load_configured_plan, reap_config
from reap_swap.engine.plugins import ENDPOINT_PLUGIN
from reap_swap.engine.refusal import BudgetRefused
from reap_swap.plan.active_set import ActiveSetError, BudgetExceeded, RefreshLimitExceeded, SwapRequest
from reap_swap.plan.bare import NO_PLAN_HINT
from reap_swap.plan.document import json_path
from reap_swap.server.budget import fill_budget
from reap_swap.server.cache_status import CacheMetrics, refresh
from reap_swap.server.controller import Metrics, SwapController, UnknownCartridge, WorkerSwapFailed
from reap_swap.server.swap_failure import CapacityExceeded

log = get_logger("reap_swap.server.routes")

SWAPS = Counter("reap_swap_swaps", "REAP swap requests by kind and outcome", ["kind", "outcome"])
SWAP_SECONDS = Histogram(
    "reap_swap_swap_seconds",
    "REAP swap latency (validation to response)",
    ["kind"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
BYTES_COPIED = Counter("reap_swap_bytes_copied", "Expert bytes copied into device memory by swaps")
ROUTED = Counter("reap_swap_routed_selections", "Routed (token, expert) selections read from the workers")
MISSED = Counter("reap_swap_missed_selections", "Routed selections of experts outside the resident set")


class PrometheusMetrics(Metrics):
    def __init__(self) -> None:
        self.cache_metrics = CacheMetrics()

    def cache(self, cache) -> None:
        self.cache_metrics.update(cache)

    def swap(self, kind: str, outcome: str, seconds: float, bytes_copied: int) -> None:
        SWAPS.labels(kind=kind, outcome=outcome).inc()
        SWAP_SECONDS.labels(kind=kind).observe(seconds)
        if bytes_copied:
            BYTES_COPIED.inc(bytes_copied)

    def selections(self, routed: int, missed: int) -> None:
        if routed:
            ROUTED.inc(routed)
        if missed:
            MISSED.inc(missed)


class CartridgeSwap(BaseModel):
    """Optional body of POST /swap_cartridge/{id}."""

    model_config = ConfigDict(extra="forbid")
    request_id: StrictStr | None = Field(default=None, min_length=1)
    phase: Literal["prefill", "decode_refresh"] = "prefill"
    budget_bytes: StrictInt | None = Field(default=None, ge=0)


class ReapError(Exception):
    """Raised by handlers and dependencies; rendered by `reap_error_handler` (not vLLM's)."""

    def __init__(self, status: int, type_: str, message: str, field: str | None = None, **extra: Any):
        super().__init__(message)
        self.status, self.type, self.message, self.field, self.extra = status, type_, message, field, extra


def json_response(content: Any, status_code: int = 200) -> Response:
    """`content` as orjson bytes: what FastAPI's deprecated ORJSONResponse rendered (same options),
    without a response model (the bodies are the controller's dicts)."""
    body = orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status_code, media_type="application/json")


async def reap_error_handler(_request: Request, exc: ReapError) -> Response:
    body = {"message": exc.message, "type": exc.type, "field": exc.field, "code": exc.status, **exc.extra}
    return json_response({"error": body}, status_code=exc.status)


_BRANCH_TAGS = {"int", "str", "bool", "float", "list", "dict", "none"}


def _loc_field(loc: tuple) -> str:
    parts = list(loc)
    while parts and isinstance(parts[-1], str) and (parts[-1] in _BRANCH_TAGS or "[" in parts[-1]):
        parts.pop()  # union-branch markers pydantic appends, e.g. ('active_set','layer_0',1,'int')
    return json_path(parts) if parts else "body"


def _validation_error(exc: ValidationError) -> ReapError:
    errors = [{"field": _loc_field(tuple(e["loc"])), "message": e["msg"]} for e in exc.errors()]
    first = errors[0]
    return ReapError(
        422, "invalid_request", f"{first['field']}: {first['message']}", first["field"], errors=errors[:10]
    )


async def _json_body(request: Request, allow_empty: bool = False) -> Any:
    raw = await request.body()
    if allow_empty and not raw.strip():
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ReapError(400, "invalid_json", f"body: not valid JSON ({exc})", "body") from None


def _parse(model: type[BaseModel], data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _controller(request: Request) -> SwapController:
    controller = getattr(request.app.state, "reap", None)
    if controller is None:
        reason = getattr(request.app.state, "reap_error", "reap-swap is not initialised")
        raise ReapError(503, "not_configured", reason)
    return controller


def _hash(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def _check_auth(request: Request) -> None:
    keys: list[bytes] = getattr(request.app.state, "reap_api_keys", [])
    if not keys:
        return
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    ok = False
    if scheme.lower() == "bearer":
        digest = _hash(token)
        for key in keys:  # no early exit: constant time over the key list
            ok |= secrets.compare_digest(digest, key)
    if not ok:
        raise ReapError(
            401,
            "unauthorized",
            "Authorization: a valid 'Bearer <api key>' is required (the server runs with --api-key)",
            "Authorization",
        )


async def _run_swap(controller: SwapController, coro) -> Response:
    try:
        return json_response(await coro)
    except (BudgetExceeded, CapacityExceeded) as exc:  # more than the budget / the workers hold
        raise ReapError(
            422, exc.error_type, str(exc), exc.field, **exc.numbers(), signature=controller.sig
        ) from None
    except ActiveSetError as exc:
        raise ReapError(422, "invalid_active_set", str(exc), exc.field) from None
    except RefreshLimitExceeded as exc:
        raise ReapError(
            429, "refresh_limit", f"phase: {exc}", "phase", limit=exc.limit, request_id=exc.request_id
        ) from None
    except WorkerSwapFailed as exc:
        raise ReapError(
            500,
            "worker_failed",
            str(exc),
            None,
            rolled_back=exc.rolled_back,
            rollback_error=exc.rollback_error,
            signature=controller.sig,
            failed_ranks=exc.failed_ranks,
            workers=exc.workers,
            workers_consistent=exc.workers_consistent,
        ) from None


router = APIRouter(tags=["reap-swap"])
_SWAP_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": SwapRequest.model_json_schema()}},
    }
}


@router.post("/swap_active_set", openapi_extra=_SWAP_BODY)
async def swap_active_set(request: Request):
    _check_auth(request)
    controller = _controller(request)
    req = _parse(SwapRequest, await _json_body(request))
    return await _run_swap(controller, controller.swap(req, "warm" if req.warm_start_only else "swap"))


@router.post("/warm_active_set", openapi_extra=_SWAP_BODY)
async def warm_active_set(request: Request):
    _check_auth(request)
    controller = _controller(request)
    req = _parse(SwapRequest, await _json_body(request)).model_copy(update={"warm_start_only": True})
    return await _run_swap(controller, controller.swap(req, "warm"))


@router.post("/swap_cartridge/{cartridge_id}")
async def swap_cartridge(cartridge_id: str, request: Request):
    _check_auth(request)
    controller = _controller(request)
    body = _parse(CartridgeSwap, await _json_body(request, allow_empty=True))
    rid = body.request_id or f"cartridge:{cartridge_id}"
    try:
        return await _run_swap(
            controller, controller.swap_cartridge(cartridge_id, rid, body.phase, body.budget_bytes)
        )
    except UnknownCartridge:
        raise ReapError(
            404,
            "not_found",
            f"cartridge_id: unknown cartridge {cartridge_id!r}; "
            + (
                f"cartridges come from a plan; {NO_PLAN_HINT}"
                if controller.plan.bare
                else f"defined: {sorted(controller.cartridge_defs)}"
            ),
            "cartridge_id",
        ) from None


_BOOL = TypeAdapter(bool)


@router.get("/router_misses/{request_id}")
async def router_misses(request_id: str, request: Request):
    _check_auth(request)
    controller = _controller(request)
    reset = _query_bool(request, "reset")
    out = await controller.router_misses(request_id, reset)
    if out is None:
        raise ReapError(
            404,
            "not_found",
            f"request_id: no statistics for request {request_id!r} "
            "(never opened by a swap or warm, or evicted)",
            "request_id",
        )
    return json_response(out)


@router.get("/forensics/{request_id}")
async def forensics(request_id: str, request: Request):
    _check_auth(request)
    controller = _controller(request)
    record = controller.forensics.get(request_id)
    if record is None:
        raise ReapError(404, "not_found", f"request_id: no forensic record for {request_id!r}", "request_id")
    return json_response(
        {
            **record,
            "refresh_count": controller.refreshes.count(request_id),
            "plan_identity": controller.plan.identity,
        }
    )


@router.get("/reap/status")
async def status(request: Request):
    _check_auth(request)
    return json_response(await _controller(request).status())


@router.get("/reap/cache/trace")
async def cache_trace(request: Request):
    """The per-step routing the expert cache was fed (rank 0; --reap-cache-record-steps N keeps
    the last N steps), in step order; ?reset=true clears it after reading."""
    _check_auth(request)
    reset = _query_bool(request, "reset")
    replies = await _controller(request).cache_trace(reset)
    first = replies[0]
    return json_response({"rank": first.rank, "recording": first.recording, "steps": first.steps})


def _query_bool(request: Request, name: str) -> bool:
    raw = request.query_params.get(name, "false")
    try:
        return _BOOL.validate_python(raw)
    except ValidationError:
        raise ReapError(
            422, "invalid_request", f"{name}: expected true or false, got {raw!r}", name
        ) from None


def api_key_digests(args: Any) -> list[bytes]:
    """The keys vLLM itself accepts: --api-key (repeatable) else VLLM_API_KEY."""
    keys = getattr(args, "api_key", None) or [os.environ.get("VLLM_API_KEY")]
    if isinstance(keys, str):
        keys = [keys]
    return [_hash(k) for k in keys if k]


class ReapEndpointPlugin:
    """The object vLLM's endpoint-plugin loader gets from `endpoint_plugin()`."""

    name = ENDPOINT_PLUGIN
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        app.include_router(router)
        app.add_exception_handler(ReapError, reap_error_handler)

    async def init_state(self, engine_client, state, args) -> None:
        state.reap = None
        state.reap_api_keys = api_key_digests(args)
        if engine_client is None:
            state.reap_error = "reap-swap needs an engine (this is a render-only server)"
            return
        cfg = reap_config(engine_client_vllm_config(engine_client).additional_config)
        if not cfg:
            state.reap_error = (
                "reap-swap endpoint plugin loaded without its configuration: start the "
                "server with `python -m reap_swap.server ... --reap-plan PLAN`"
            )
            log.error("reap-swap: %s", state.reap_error)
            return
        settings, plan = load_configured_plan(cfg)

        controller = SwapController(
            plan,
            engine_client_rpc(engine_client),
            plan_file=settings.plan_file,
            validate_only=settings.validate_only,
            max_loaded_cartridges=settings.max_loaded_cartridges,
            metrics=PrometheusMetrics(),
            keep_pool_full=settings.budget.pool != "plan",  # swaps keep the pool full (pool_fill.py)
        )
        try:  # --reap-budget auto | GiB: grow and fill the pool before serving (server/budget.py)
            state.reap_budget = await fill_budget(engine_client_rpc(engine_client))
        except BudgetRefused as exc:
            log.error("reap-swap: startup refused: %s", exc)
            raise
        controller.budget_report = state.reap_budget
        started = await controller.start()
        state.reap = controller
        if (await controller.status())["cache"].get("engaged"):
            state.reap_cache_refresh = asyncio.create_task(refresh(controller.status))
        log.info(
            "reap-swap ready: plan %s (%s), %d worker(s), residency %s, signature %s, REAP routes %s",
            plan.identity[:12],
            "none given: every expert cached on demand" if plan.bare else settings.plan_file,
            started["workers"],
            started["mode"],
            started["signature"],
            "require the API key" if state.reap_api_keys else "are open (no --api-key)",
        )


def endpoint_plugin() -> ReapEndpointPlugin:
    """Entry point `vllm.endpoint_plugins: reap_swap` (a zero-argument factory)."""
    return ReapEndpointPlugin()
