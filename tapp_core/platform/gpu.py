"""Typed wrappers of the few ``torch.cuda`` calls the runtime and the profiler make whose stubs are untyped (one
place for them).

Only called where a GPU is used; importing this module does not initialise CUDA.
"""

from __future__ import annotations

import torch


def claim(device: torch.device) -> None:
    """Make ``device`` this process's current GPU and initialise CUDA there: its memory statistics need CUDA
    initialised (``reset_peak_memory_stats`` in a fresh process fails with "Invalid device argument"), and work
    queued without naming a device goes to the current one."""
    torch.cuda.set_device(device)
    torch.cuda.init()  # type: ignore[no-untyped-call]


def new_event(timing: bool = False) -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=timing)  # type: ignore[no-untyped-call]


def recorded_event(timing: bool = False, stream: torch.cuda.Stream | None = None) -> torch.cuda.Event:
    """A new event recorded now on ``stream`` (the current stream by default)."""
    event = new_event(timing)
    event.record(stream)
    return event


def new_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def done(event: torch.cuda.Event) -> bool:
    """Whether the work before ``event`` has finished (never blocks)."""
    return bool(event.query())  # type: ignore[no-untyped-call]


def elapsed_s(start: torch.cuda.Event, end: torch.cuda.Event) -> float:
    """Seconds between two timing events that have both completed."""
    return float(start.elapsed_time(end)) / 1e3
