"""Results files: written atomically so a crash never leaves half a file.

summary.json is replaced in one rename; metrics.jsonl grows one whole line
per write, and readers skip a torn last line.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
ERRORS_DIR = "errors"
LOGS_DIR = "logs"


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write them as null so every reader can parse the file."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(_clean(obj), indent=2, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def append_jsonl(path: str | os.PathLike, record: dict) -> None:
    """One os.write of one whole line: a reader never sees a record split across writes."""
    line = (json.dumps(_clean(record), sort_keys=True) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return list(iter_jsonl(path))


def iter_jsonl(path: str | os.PathLike, start: int = 0) -> Iterator[dict]:
    try:
        with open(path) as f:
            f.seek(start)
            for line in f:
                if not line.endswith("\n"):
                    return  # torn last line: still being written
                line = line.strip()
                if line:
                    yield json.loads(line)
    except FileNotFoundError:
        return


class JsonlTail:
    """Follows a growing jsonl file, returning only whole new records."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.offset = 0

    def read_new(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        return [json.loads(l) for l in data[: end + 1].decode().splitlines() if l.strip()]
