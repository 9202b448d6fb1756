"""Reading a process's log while it grows: a run's train.log, an endpoint's server log.

Two readers, used by everything that shows a log (the run handle, ``palaestra run logs``,
``palaestra train``, the dashboard, an endpoint's error message): the last lines of a log,
and the complete lines appended past an offset. A line still being written (no newline yet)
is left for the next read, so a follower never prints half a line twice.
"""

from __future__ import annotations

from pathlib import Path

TAIL_BYTES = 512 * 1024
"""How far back from the end ``last_lines`` reads: a few thousand lines of a typical log."""


def last_lines(
    path: str | Path, count: int, *, partial: bool = True, max_bytes: int = TAIL_BYTES
) -> tuple[list[str], int | None]:
    """The last ``count`` lines of ``path`` and the byte offset just past them, or ``([],
    None)`` while there is no file. With ``partial`` a last line without its newline yet is
    shown too (and the offset is the file's end); without it, it waits for ``new_lines``."""
    try:
        with open(path, "rb") as handle:
            end = handle.seek(0, 2)
            start = handle.seek(max(0, end - max_bytes))
            chunk = handle.read(end - start)
    except (FileNotFoundError, IsADirectoryError):
        return [], None
    if not partial:
        chunk = chunk[: chunk.rfind(b"\n") + 1]
    lines = chunk.decode(errors="replace").splitlines()
    if start > 0 and lines:
        lines = lines[1:]  # the chunk began mid-line
    return (lines[-count:] if count > 0 else []), start + len(chunk)


def new_lines(path: str | Path, offset: int) -> tuple[list[str], int]:
    """The complete lines written to ``path`` past byte ``offset``, and the offset after them."""
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            chunk = handle.read()
    except (FileNotFoundError, IsADirectoryError):
        return [], offset
    end = chunk.rfind(b"\n") + 1
    return chunk[:end].decode(errors="replace").splitlines(), offset + end
