"""The host's memory as Linux reports it: this process's resident set, and what the machine has
available (0 / None where /proc is not there)."""
from __future__ import annotations


def _proc_kib(path: str, key: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def rss_bytes() -> int:
    """Resident set size of this process (0 where unknown)."""
    kib = _proc_kib("/proc/self/status", "VmRSS")
    return 0 if kib is None else kib * 1024


def available_bytes() -> int | None:
    """Memory the machine can still give (MemAvailable), or None where unknown."""
    kib = _proc_kib("/proc/meminfo", "MemAvailable")
    return None if kib is None else kib * 1024


def return_freed_memory() -> None:
    """Hand memory freed inside the C heap back to the system (glibc's `malloc_trim`).

    Why: large tensors freed after glibc has raised its mmap threshold live in the heap, and their
    pages stay resident until trimmed, so an unload or a dropped weight copy would not show in the
    process's memory. A no-op where there is no glibc."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
