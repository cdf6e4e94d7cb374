"""Where a bench ran and what the servers used: machine description, GPU memory sampling, log numbers."""

from __future__ import annotations

import os
import platform
import re
import socket
import subprocess
import threading
from pathlib import Path

from reap_swap import __version__


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def visible_gpu_ids() -> list[str]:
    """nvidia-smi `--id` arguments for the GPUs this process may use (CUDA_VISIBLE_DEVICES), or []
    for all: a bench pinned to one GPU of several must not count the others' memory."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    return [f"--id={','.join(ids)}"] if ids and all(i.isdigit() or i.startswith("GPU-") for i in ids) else []


def gpu_names() -> list[str]:
    out = _run(
        [
            "nvidia-smi",
            *visible_gpu_ids(),
            "--query-gpu=name,memory.total,driver_version",
            "--format=csv,noheader",
        ]
    )
    return [line.strip() for line in out.splitlines() if line.strip()] if out else []


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def environment() -> dict:
    """vLLM version and build, platform, GPUs (or CPU), versions; imports vLLM (a few seconds)."""
    from reap_swap.compat import offline as vllm_offline
    from reap_swap.compat import serve as vllm_serve

    dists = vllm_offline.distributions()
    plat = vllm_serve.platform_name()
    gpus = gpu_names() if plat == "cuda" else []
    commit = _run(["git", "-C", str(Path(__file__).resolve().parents[2]), "rev-parse", "--short", "HEAD"])
    return {
        "vllm_version": vllm_serve.vllm_version_string(),
        "vllm_distribution": ", ".join(dists) or "unknown",
        "platform": plat,
        "gpus": gpus,
        "cpu": cpu_name(),
        "device": ("; ".join(gpus) if gpus else f"GPU ({plat})")
        if plat == "cuda"
        else f"CPU only: {cpu_name()}",
        "python": platform.python_version(),
        "reap_swap_version": __version__,
        "git_commit": commit,
        "hostname": socket.gethostname(),
    }


class GpuMemorySampler:
    """Peak nvidia-smi memory.used over the visible GPUs while an arm runs (0.5 s period), minus
    nothing: the baseline before the server started is recorded next to it."""

    def __init__(self, period_s: float = 0.5):
        self.period_s = period_s
        self.baseline: int | None = None
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def used_bytes() -> int | None:
        out = _run(
            ["nvidia-smi", *visible_gpu_ids(), "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        )
        if not out:
            return None
        return sum(int(float(x)) for x in out.split()) * 2**20

    def _loop(self) -> None:
        while not self._stop.is_set():
            used = self.used_bytes()
            if used is not None:
                self.peak = used if self.peak is None else max(self.peak, used)
            self._stop.wait(self.period_s)

    def __enter__(self) -> GpuMemorySampler:
        self.baseline = self.used_bytes()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


_LOG_NUMBERS = {
    "model_loading_gib": re.compile(r"Model loading took ([\d.]+) ?GiB"),
    "kv_cache_gib": re.compile(r"Available KV cache memory: ([\d.]+) ?GiB"),
    "uva_offloaded_gib": re.compile(r"Total CPU offloaded parameters: ([\d.]+)"),
    "reap_pool_gib": re.compile(r"reserved HBM pool of \d+ expert slots \(([\d.]+) GiB"),
}


def log_numbers(log_text: str) -> dict:
    """Memory figures vLLM (and the reap engine) print while loading: last occurrence of each."""
    found = {}
    for key, pattern in _LOG_NUMBERS.items():
        hits = pattern.findall(log_text)
        if hits:
            found[key] = float(hits[-1])
    return found


class MeasureLock:
    """An exclusive file lock (``fcntl.flock``) taken once an arm's server is healthy and held
    until that server has stopped (``--measure-lock PATH``).

    Why: several benches may start their servers side by side on one GPU to overlap the slow
    start-ups (torch.compile, CUDA graphs, pinning); with the same PATH only one of them measures
    at a time, so no arm's timings share the GPU, the PCIe link or the host with another arm's
    requests. Start-ups still overlap measurements (CPU load), which the report states.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._fh = None
        self.waited_s: float | None = None

    def acquire(self) -> float | None:
        """Block until the lock is ours; the seconds waited (None without a path)."""
        if self.path is None or self._fh is not None:
            return self.waited_s
        import fcntl
        import time

        t0 = time.monotonic()
        self._fh = open(self.path, "a+")  # noqa: SIM115 - held across the server's lifetime
        fcntl.flock(self._fh, fcntl.LOCK_EX)
        self.waited_s = round(time.monotonic() - t0, 1)
        return self.waited_s

    def release(self) -> None:
        if self._fh is not None:
            import fcntl

            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None
