"""A benchmark process's own memory figures on Linux (``/proc/self``), shared by the benchmarks that measure peak
memory in a process of their own (not a benchmark).

Peak memory is read as ``VmHWM`` (the resident set's high-water mark) after ``echo 5 > /proc/self/clear_refs`` has
reset it to the current resident set; the figure a benchmark reports is that peak above a baseline it read with
:func:`status_kib` (``VmRSS``) after its imports, so that the interpreter's and torch's own few hundred MiB do not
dilute it.
"""

from __future__ import annotations

import re


def status_kib(field: str) -> int:
    """One field of ``/proc/self/status`` in KiB: ``"VmRSS"`` (resident now) or ``"VmHWM"`` (peak resident)."""
    with open("/proc/self/status") as handle:
        return int(re.search(rf"^{field}:\s+(\d+) kB", handle.read(), re.M).group(1))


def reset_peak() -> bool:
    """Reset ``VmHWM`` to the current resident set; False where the kernel refuses (then the peak is the process's
    whole-life peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False
