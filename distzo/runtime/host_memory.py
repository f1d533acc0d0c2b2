"""This machine's and this process's memory figures, read from /proc (Linux)."""

from __future__ import annotations

import resource
from pathlib import Path

# a cgroup limit at or above this is "no limit" (v1 writes 2^63 rounded down to a page)
_NO_LIMIT = 1 << 62


def _proc_kib(path: str, field: str) -> int | None:
    """A ``field: N kB`` line of a /proc file, in bytes; None where there is none."""
    try:
        with open(path) as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def peak_rss_bytes() -> int:
    """The high-water mark of this process's resident set (VmHWM).

    Not ``getrusage().ru_maxrss``: Linux carries that across fork + exec, so a process
    started by a large parent (a test runner, a launcher) reports the parent's peak.
    """
    peak = _proc_kib("/proc/self/status", "VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int | None:
    """This process's resident set now (VmRSS)."""
    return _proc_kib("/proc/self/status", "VmRSS")


def reset_peak_rss() -> bool:
    """Restart the VmHWM high-water mark from the current RSS (Linux: writing 5 to
    /proc/self/clear_refs), so a later ``peak_rss_bytes`` covers only what ran since.
    False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def available_host_bytes() -> int | None:
    """Memory this process could get without swapping or being killed: the machine's
    MemAvailable, or the room under its cgroup's memory limit (SLURM's ``--mem``, a
    container's limit) where that is less; the kernel kills a cgroup past its limit however
    much the machine has free."""
    readings = [_proc_kib("/proc/meminfo", "MemAvailable"), cgroup_room_bytes()]
    known = [reading for reading in readings if reading is not None]
    return min(known) if known else None


def cgroup_room_bytes(
    proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
) -> int | None:
    """The room left under the tightest memory limit of this process's cgroup and its
    ancestors (cgroup v2, or v1's memory controller): the limit less the usage, counting
    inactive page cache as free, as the kernel reclaims it before killing. None where no
    limit is set or none can be read."""
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    entries = [line.split(":", 2) for line in lines if line.count(":") >= 2]
    for _, controllers, path in entries:
        if "memory" in controllers.split(","):
            return _v1_room(Path(root) / "memory", path)
    unified = [path for hierarchy, _, path in entries if hierarchy == "0"]
    return _v2_room(Path(root), unified[0]) if unified else None


def _cgroup_dir(mount: Path, path: str) -> Path:
    """The cgroup's folder under its mount; the mount itself inside a container, whose
    mount is its own cgroup while /proc names the host's path."""
    inner = mount / path.lstrip("/")
    return inner if inner.is_dir() else mount


def _stat_field(folder: Path, field: str) -> int:
    """A field of a cgroup's memory.stat (0 where absent)."""
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == field:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _read_int(file: Path) -> int | None:
    """A cgroup file's number; None for ``max``, a missing file or an unreadable one."""
    try:
        text = file.read_text().strip()
        return int(text) if text != "max" else None
    except (OSError, ValueError):
        return None


def _room(limit: int | None, usage: int | None, reclaimable: int) -> int | None:
    """Room under one limit; None where there is no limit."""
    if limit is None or limit >= _NO_LIMIT or usage is None:
        return None
    return max(0, limit - max(0, usage - reclaimable))


def _v1_room(mount: Path, path: str) -> int | None:
    """cgroup v1: memory.stat's hierarchical limit is already the tightest of the
    ancestors'."""
    folder = _cgroup_dir(mount, path)
    limit = _stat_field(folder, "hierarchical_memory_limit") or _read_int(
        folder / "memory.limit_in_bytes"
    )
    usage = _read_int(folder / "memory.usage_in_bytes")
    return _room(limit, usage, _stat_field(folder, "total_inactive_file"))


def _v2_room(mount: Path, path: str) -> int | None:
    """cgroup v2: each ancestor up to the mount may hold its own memory.max."""
    folder = _cgroup_dir(mount, path)
    rooms = []
    while True:
        room = _room(
            _read_int(folder / "memory.max"),
            _read_int(folder / "memory.current"),
            _stat_field(folder, "inactive_file"),
        )
        if room is not None:
            rooms.append(room)
        if folder == mount or mount not in folder.parents:
            break
        folder = folder.parent
    return min(rooms) if rooms else None
