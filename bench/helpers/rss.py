"""Peak resident memory of this process over a window, for code the tensor probe cannot see.

[Note: peak RSS on Linux]
``LiveTensorBytes`` sees only tensors created through Python dispatch; Inductor's
generated code allocates its buffers directly. For it we read the kernel's
high-water mark of resident memory (``VmHWM`` in /proc/self/status) after
resetting it (writing 5 to /proc/self/clear_refs). Two conditions make the
number mean something: glibc must return freed tensor memory to the kernel at
once, so the process is started with ``MALLOC_MMAP_THRESHOLD_=65536
MALLOC_TRIM_THRESHOLD_=0`` (every block over 64 KiB is its own mmap, unmapped
on free); and only the difference over the window is read, since the base
includes the interpreter, libraries and compiled code.
"""

from __future__ import annotations

import os

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


def rss_supported() -> bool:
    return os.path.exists("/proc/self/clear_refs") and all(
        os.environ.get(k) == v for k, v in MALLOC_ENV.items())


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def resident_bytes() -> int:
    """This process's resident size now, in bytes."""
    return _status("VmRSS")


def reset_peak_rss() -> int:
    """Reset the high-water mark to the current resident size; return that size in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return resident_bytes()


def peak_rss() -> int:
    """Highest resident size in bytes since the last ``reset_peak_rss``."""
    return _status("VmHWM")
