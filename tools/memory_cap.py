"""Run a command under a RAM cap and measure its peak resident set.

The cap, by the first means that works here:

1. ``cgroup``: a child of this process's own memory cgroup (v1 ``memory.limit_in_bytes``, v2 ``memory.max``), which
   the command joins before it starts. The kernel counts resident memory and page cache there; it reclaims cache
   (shards read, files written) before it kills, so only memory the command really holds can break the cap.
2. ``watchdog``: the command's ``VmRSS`` polled every ``poll_s`` seconds and the command killed when over the cap.

Either way the command's ``VmHWM`` (its peak resident set, file-backed pages of mapped shards included) and its
``RssAnon`` (the memory it holds itself, not page cache) are polled: a peak within the last poll before exit can be
missed (quantkit's own ``--json`` reports its ``VmHWM`` at the end of the work). Not ``ru_maxrss``: exec keeps the
forking parent's high-water mark in it, so a large parent inflates the child's figure.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(slots=True)
class CappedRun:
    returncode: int
    seconds: float
    cap_bytes: int
    enforcement: str  # "cgroup v1", "cgroup v2" or "watchdog"
    peak_rss_bytes: int  # the command's VmHWM, last polled reading
    peak_anon_bytes: int  # the largest RssAnon polled: resident memory that is not file-backed
    max_sampled_rss_bytes: int  # the largest VmRSS seen by the poller
    killed_over_cap: bool
    cgroup_peak_bytes: int | None = None  # resident + page cache charged to the cgroup at its peak (cgroup only)


def _status_kb(pid: int, field: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class _Cgroup:
    """A child memory cgroup of this process's own, with a limit; removed by :meth:`remove`."""

    def __init__(self, path: Path, version: int) -> None:
        self.path, self.version = path, version

    @classmethod
    def create(cls, cap_bytes: int) -> _Cgroup | None:
        found = _own_memory_cgroup()
        if found is None:
            return None
        parent, version = found
        path = parent / f"quantkit-cap-{os.getpid()}"
        limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
        try:
            path.mkdir()
        except OSError:
            return None
        group = cls(path, version)
        try:
            (path / limit_file).write_text(str(cap_bytes))
            written = (path / limit_file).read_text().strip()
            if written == "max" or int(written) > cap_bytes:
                raise OSError(f"the limit did not hold ({written})")
        except (OSError, ValueError):
            group.remove()
            return None
        return group

    def join(self) -> None:
        """Move the calling process in (from the child, before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError):
            return None

    def oom_killed(self) -> bool:
        try:
            if self.version == 1:
                text = (self.path / "memory.oom_control").read_text()
                return any(line.split()[1] != "0" for line in text.splitlines() if line.startswith("oom_kill "))
            text = (self.path / "memory.events").read_text()
            return any(line.split()[1] != "0" for line in text.splitlines() if line.startswith("oom_kill "))
        except (OSError, IndexError):
            return False

    def remove(self) -> None:
        for _ in range(50):  # the last process may still be leaving
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _own_memory_cgroup() -> tuple[Path, int] | None:
    """(directory, version) of this process's memory cgroup, when the cgroup filesystem shows it."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            base = CGROUP_ROOT / "memory"
            own = base / path.lstrip("/")
            return (own if own.is_dir() else base), 1
    for line in lines:
        if line.startswith("0::") and "memory" in _read(CGROUP_ROOT / "cgroup.controllers"):
            own = CGROUP_ROOT / line[3:].lstrip("/")
            return (own if own.is_dir() else CGROUP_ROOT), 2
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def run_capped(
    command: list[str],
    cap_bytes: int,
    *,
    env: dict[str, str] | None = None,
    on_line=None,
    poll_s: float = 0.05,
    use_cgroup: bool = True,
) -> CappedRun:
    """Run ``command`` under the cap; ``on_line(text)`` gets each line of its merged stdout/stderr as it comes."""
    group = _Cgroup.create(cap_bytes) if use_cgroup else None
    enforcement = f"cgroup v{group.version}" if group else "watchdog"
    start = time.perf_counter()
    proc = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        preexec_fn=group.join if group else None,  # runs in the child before exec, where no threads run
    )
    peak = {"hwm": 0, "rss": 0, "anon": 0, "killed": False}
    exited = threading.Event()

    def poll() -> None:  # never reaps the process: the main thread does, with its resource usage
        while not exited.is_set():
            hwm, rss, anon = (_status_kb(proc.pid, field) for field in ("VmHWM", "VmRSS", "RssAnon"))
            peak["hwm"] = max(peak["hwm"], (hwm or 0) * 1024)
            peak["anon"] = max(peak["anon"], (anon or 0) * 1024)
            if rss is not None:
                peak["rss"] = max(peak["rss"], rss * 1024)
                if group is None and rss * 1024 > cap_bytes:
                    peak["killed"] = True
                    os.kill(proc.pid, signal.SIGKILL)
            time.sleep(poll_s)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        if on_line is not None:
            on_line(line.rstrip("\n"))
    _, status, _ = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    exited.set()
    poller.join()
    returncode = proc.returncode = os.waitstatus_to_exitcode(status)
    killed = peak["killed"]
    cgroup_peak = None
    if group is not None:
        cgroup_peak = group.peak_bytes()
        killed = group.oom_killed() or (returncode == -signal.SIGKILL)
        group.remove()
    return CappedRun(
        returncode=returncode,
        seconds=seconds,
        cap_bytes=cap_bytes,
        enforcement=enforcement,
        peak_rss_bytes=peak["hwm"],
        peak_anon_bytes=peak["anon"],
        max_sampled_rss_bytes=peak["rss"],
        killed_over_cap=killed,
        cgroup_peak_bytes=cgroup_peak,
    )
