"""What every JSON record of TAPP (a plan, a calibration) does alike when it is read or written: one clear error
naming the record and its source, and a file written whole with its folder made."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tapp_core.errors import TappError


def json_object(text: str, what: str, source: str, error: type[TappError]) -> dict[str, object]:
    """``text`` as a JSON object; else ``error`` saying that ``what`` at ``source`` is not valid JSON or no object."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what} {source} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{what} {source} must be a JSON object")
    return data


def write_record(path: str | Path, text: str) -> Path:
    """Write ``text`` and a final newline to ``path``, making its folder; the path written. The file appears whole
    or not at all (written beside it, then renamed): a reader never takes a half-written record."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        staging.write_text(text + "\n")
        os.replace(staging, out)
    finally:
        staging.unlink(missing_ok=True)
    return out
