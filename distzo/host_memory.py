"""This machine's and this process's memory figures, read from /proc (Linux)."""

from __future__ import annotations

import resource


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


def available_host_bytes() -> int | None:
    """Memory the kernel could give without swapping (MemAvailable)."""
    return _proc_kib("/proc/meminfo", "MemAvailable")
