"""The host's available memory, as Linux reports it (what a model or a packed copy may still take)."""

from __future__ import annotations


def host_free_bytes() -> int | None:
    """MemAvailable from /proc/meminfo in bytes; None where it cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
