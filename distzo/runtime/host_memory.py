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
    """Memory the kernel could give without swapping (MemAvailable)."""
    return _proc_kib("/proc/meminfo", "MemAvailable")
