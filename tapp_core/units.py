"""Parsing of human-written quantities in cluster files: sizes, bandwidths, durations.

Internally TAPP uses SI base units everywhere: bytes, bytes per second, seconds.
"""

from __future__ import annotations

import math
import re

from tapp_core.errors import TappError

_SIZE = {
    "b": 1,
    "kb": 1e3,
    "mb": 1e6,
    "gb": 1e9,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
# Bandwidths in bits per second are the norm for links; bytes per second are accepted with a capital B.
_RATE_BITS = {"bit/s": 1, "kbit/s": 1e3, "mbit/s": 1e6, "gbit/s": 1e9, "tbit/s": 1e12}
_RATE_BYTES = {"B/s": 1, "KB/s": 1e3, "MB/s": 1e6, "GB/s": 1e9, "KiB/s": 2**10, "MiB/s": 2**20, "GiB/s": 2**30}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}

_EXAMPLE = {"size": "4GiB", "bandwidth": "1Gbit/s", "duration": "100us"}
_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ/]*)\s*$")


class UnitError(TappError):
    """A quantity that could not be read; the message says what was expected."""


def _split(value: object, what: str) -> tuple[float, str]:
    """The number and the unit of ``value``; the number is finite (``1e400`` reads as infinity: refused)."""
    if isinstance(value, bool):
        raise UnitError(f"expected a {what}, got {value!r}")
    if isinstance(value, int | float):
        number, unit = float(value), ""
    elif isinstance(value, str) and (match := _NUMBER_UNIT.match(value)):
        number, unit = float(match.group(1)), match.group(2)
    else:
        raise UnitError(f"expected a {what} such as {_EXAMPLE[what]}, got {value!r}")
    if not math.isfinite(number):
        raise UnitError(f"expected a finite {what} such as {_EXAMPLE[what]}, got {value!r}")
    return number, unit


def _finite(number: float, value: object, what: str) -> float:
    """``number`` (``value`` in base units); a finite number times a large unit can still overflow to infinity."""
    if not math.isfinite(number):
        raise UnitError(f"{what} {value!r} is too large")
    return number


def parse_bytes(value: object) -> int:
    """'4GiB' -> 4294967296; a bare number is bytes."""
    number, unit = _split(value, "size")
    factor = _SIZE.get(unit.lower()) if unit else 1
    if factor is None:
        raise UnitError(f"unknown size unit {unit!r} in {value!r} (use B, KB, MB, GB, KiB, MiB, GiB)")
    return int(_finite(number * factor, value, "size"))


def parse_bandwidth(value: object) -> float:
    """'1Gbit/s' -> 1.25e8 bytes/s; '100MB/s' -> 1e8 bytes/s; a bare number is bytes/s."""
    number, unit = _split(value, "bandwidth")
    if unit == "":
        return number
    if unit in _RATE_BYTES:
        return _finite(number * _RATE_BYTES[unit], value, "bandwidth")
    factor = _RATE_BITS.get(unit.lower())
    if factor is None:
        raise UnitError(f"unknown bandwidth unit {unit!r} in {value!r} (use Mbit/s, Gbit/s, MB/s, GB/s)")
    return _finite(number * factor / 8.0, value, "bandwidth")


def parse_seconds(value: object) -> float:
    """'100us' -> 1e-4; a bare number is seconds."""
    number, unit = _split(value, "duration")
    if unit == "":
        return number
    factor = _TIME.get(unit)
    if factor is None:
        raise UnitError(f"unknown time unit {unit!r} in {value!r} (use s, ms, us, ns)")
    return number * factor
