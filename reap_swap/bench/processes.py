"""Which processes belong to a server we started, and stopping all of them (Linux /proc; stdlib only).

Why more than the process group: vLLM's engine core and workers normally stay in the server's
group (``start_new_session``), but a descendant that starts its own session would survive a
``killpg`` and keep holding memory (or a GPU) while the next server starts. A server's *family* is
its group plus every descendant of its leader; ``kill_group`` signals the group and then every
family member (and every pid seen earlier, e.g. at startup) outside it, and waits until none is
alive. Zombies count as gone (they hold no memory; their parent or init reaps them).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from pathlib import Path


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, pgid) of every live, non-zombie process."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if fields[0] == "Z":
            continue
        table[int(entry.name)] = (int(fields[1]), int(fields[2]))
    return table


def group_alive(pgid: int) -> list[int]:
    """Pids still in process group ``pgid``."""
    return sorted(pid for pid, (_, group) in process_table().items() if group == pgid)


def process_family(root_pid: int, pgid: int | None = None) -> set[int]:
    """Live processes of group ``pgid`` (default: ``root_pid``'s own group id) plus every
    descendant of ``root_pid`` or of a group member (in case one left the group)."""
    table = process_table()
    pgid = root_pid if pgid is None else pgid
    found = {pid for pid, (_, group) in table.items() if group == pgid}
    frontier = {root_pid} | found
    while frontier:
        children = {pid for pid, (ppid, _) in table.items() if ppid in frontier} - found
        found |= children
        frontier = children
    return {pid for pid in found if pid in table}


def kill_group(
    proc: subprocess.Popen,
    grace_s: float = 30.0,
    members: Callable[[], set[int]] | None = None,
    known: Iterable[int] = (),
) -> list[int]:
    """SIGTERM, then SIGKILL, the process group of ``proc`` (a session leader) and every other
    process that must go; returns the pids that survived both.

    ``members`` (default: ``proc``'s family plus those of ``known`` still alive) names every
    process that must be gone; those outside the group are signalled one by one."""
    pgid = proc.pid  # start_new_session: the group id is the leader's pid, even after it exited
    known = set(known)
    if members is None:

        def members() -> set[int]:
            return process_family(pgid, pgid) | (known & set(process_table()))

    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass
        for pid in members() - set(group_alive(pgid)) - {proc.pid}:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()
            if not members():
                return []
            time.sleep(0.2)
    proc.poll()
    return sorted(members())
