"""How much freed memory a CPU rank's C allocator keeps resident (glibc's ``malloc``).

glibc serves a large block from a mapping of its own, which it unmaps when the block is freed, and a smaller one
from its heap, whose freed blocks stay resident for the next. What "large" means moves: the threshold rises to the
largest mapped block freed (up to 32 MiB), after which a stage's transient tensors come from the heap and stay:
measured on VGG-16's split stage under AdamW, 25-35 MiB over what its tensors hold in a step, and 100 MiB more
after reading a training set. Fixing the threshold at its starting value gives that back at once, but every large
tensor then costs fresh pages: 13-40 % of a rank's speed (13-28 % on the main job's plans, 28-40 % on
VGG-16's under AdamW). So a rank fixes it only where
its memory is a real limit (``bound_freed_memory``): its memory control group's limit is no more than its
device's ``memory:``, as on a testbed host (``tapp testbed up``) or in a container sized as the device. Elsewhere
it keeps glibc's default, and gives back what it freed between plans (``release_freed_memory``).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc

from tapp_core.platform.testbed.cgroups import Cgroups

M_MMAP_THRESHOLD = -3
"""``mallopt``'s parameter for the mmap threshold (``malloc.h``); setting it stops the threshold moving."""
MMAP_THRESHOLD_BYTES = 128 * 1024
"""glibc's starting threshold: a block this large or larger is mapped, and unmapped when freed."""


def bounding_environment() -> dict[str, str]:
    """The environment under which a new process's glibc gives every large block back when it is freed from its
    start, as ``bound_freed_memory`` makes a rank do (glibc's ``MALLOC_MMAP_THRESHOLD_`` tunable): for ranks
    measured as they run under a real limit, where none is (``bench/memory.py``)."""
    return {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD_BYTES)}


def release_freed_memory() -> None:
    """Give the memory freed so far back to the system (``malloc_trim``): the C allocator otherwise keeps it
    resident, and what is allocated next lands beside it rather than in it, so the resident set grows by both."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def memory_limit() -> int | None:
    """The lowest memory limit of this process's control group and the groups above it, in bytes (None: none)."""
    cgroups = Cgroups.find()
    if cgroups is None:
        return None
    group = cgroups.memory_group_of()
    return cgroups.effective_memory_limit(group) if group is not None else None


def bound_freed_memory(device_memory_bytes: int) -> bool:
    """Where this process's memory limit is at most ``device_memory_bytes``, make the C allocator give every large
    block back when it is freed; whether it did (False elsewhere, and where the C library is not glibc)."""
    limit = memory_limit()
    if limit is None or limit > device_memory_bytes:
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False
