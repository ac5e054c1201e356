"""This process's memory: what the stages report (peak) and what the refit checks before it
allocates (available)."""

from __future__ import annotations

import os
import resource


def peak_rss_gib() -> float:
    """The process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def available_memory() -> int:
    """Bytes of memory available now (Linux: MemAvailable; elsewhere the physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
