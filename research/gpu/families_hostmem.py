"""Per-server memory sampling for research/gpu/gpu_families.py (issue 15): the host's MemTotal -
MemAvailable (shared by every process; the only place the engine's cuMemCreate host backing
shows), the RSS of the server's process tree, and the HBM of its processes (nvidia-smi compute
apps); and the guard that kills the server before the kernel's OOM killer picks a victim."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from reap_swap.bench.processes import kill_group
from reap_swap.bench.server_driver import log

GIB = 2**30


def meminfo() -> dict[str, int]:
    out = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
    return out


def tree_pids(proc) -> list[int]:
    import psutil

    try:
        p = psutil.Process(proc.pid)
        return [p.pid] + [c.pid for c in p.children(recursive=True)]
    except psutil.Error:
        return []


def tree_rss(pids: list[int]) -> int:
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            pass
    return total


def hbm_by_pid() -> dict[int, int]:
    """nvidia-smi compute apps: pid -> bytes of device memory (empty where nvidia-smi is absent)."""
    try:
        text = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        ).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return {}
    out = {}
    for line in text.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            out[int(parts[0])] = int(parts[1]) * 2**20
    return out


class HostMemory:
    """Samples every 0.5 s while a server lives (HBM every 2 s); kills it under the guard."""

    def __init__(self, guard_gib: float):
        self.guard = guard_gib * GIB
        self.base = meminfo()
        self.peak_used, self.min_available = 0, self.base["MemAvailable"]
        self.rss_peak = self.hbm_peak = 0
        self.killed, self.server = False, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        ticks = 0
        while not self._stop.wait(0.5):
            m = meminfo()
            self.peak_used = max(self.peak_used, m["MemTotal"] - m["MemAvailable"])
            self.min_available = min(self.min_available, m["MemAvailable"])
            proc = getattr(self.server, "proc", None)
            if proc is None:
                continue
            pids = tree_pids(proc)
            self.rss_peak = max(self.rss_peak, tree_rss(pids))
            ticks += 1
            if ticks % 4 == 0:
                used = hbm_by_pid()
                self.hbm_peak = max(self.hbm_peak, sum(used.get(p, 0) for p in pids))
            if m["MemAvailable"] < self.guard and not self.killed:
                self.killed = True
                log("host memory guard: MemAvailable", m["MemAvailable"] / GIB, "GiB; killing the server")
                kill_group(proc)

    def __enter__(self) -> HostMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def snapshot(self) -> dict:
        total = self.base["MemTotal"]
        return {
            "host_total_gib": round(total / GIB, 2),
            "host_used_before_gib": round((total - self.base["MemAvailable"]) / GIB, 2),
            "host_peak_used_gib": round(self.peak_used / GIB, 2),
            "host_min_available_gib": round(self.min_available / GIB, 2),
            "rss_peak_gib": round(self.rss_peak / GIB, 2),
            "hbm_peak_gib": round(self.hbm_peak / GIB, 2),
            "killed_by_guard": self.killed,
            "at": time.time(),
        }
