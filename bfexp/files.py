"""Reading a file bfexp did not write (a user's corpus, a results file someone pointed at) without trusting it.

A path may name anything: a FIFO (whose open blocks until a writer comes), a
device (``/dev/zero`` never ends), a symbolic link to either, or a file far
larger than its kind ever is. ``read_file`` opens without blocking, takes
regular files only and refuses one larger than its kind allows, before
reading a byte: an OSError naming the path and what it is, which each caller
turns into its own one-line error.
"""

from __future__ import annotations

import os
import stat

__all__ = ["NotARegularFile", "TooLarge", "read_file", "GiB", "MiB"]

MiB = 2**20
GiB = 2**30


class NotARegularFile(OSError):
    """The path is a FIFO, a device, a socket or a folder: nothing bfexp reads as data."""


class TooLarge(OSError):
    """The file is larger than anything of its kind bfexp reads."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")):
        if test(mode):
            return name
    return "not a regular file"


def read_file(path: str | os.PathLike, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes. FileNotFoundError and other OSErrors as open()
    raises them; NotARegularFile (e.g. /dev/zero, a FIFO: its open does not block) and TooLarge before reading."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotARegularFile(0, f"{_kind(info.st_mode)}, not a regular file", str(path))
        if info.st_size > limit:
            raise TooLarge(0, f"{info.st_size} bytes, more than the {limit} this kind of file may hold", str(path))
        os.set_blocking(fd, True)
        chunks, left = [], limit + 1  # a file that grows while read still stops at the limit
        while left > 0:
            chunk = os.read(fd, min(left, 16 * MiB))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            raise TooLarge(0, f"more than the {limit} bytes this kind of file may hold", str(path))
        return data
    finally:
        os.close(fd)
