"""This process's peak resident memory, measured so that it means this process."""

from __future__ import annotations

import resource


def peak_rss_bytes() -> int:
    """The high-water mark of this process's resident set (VmHWM).

    Not ``getrusage().ru_maxrss``: Linux carries that across fork + exec, so a process
    started by a large parent (a test runner, a launcher) reports the parent's peak.
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
