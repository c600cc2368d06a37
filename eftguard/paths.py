"""Paths: output paths checked before any work (a run, a bench or a key that fails to be written at the end loses
everything computed before it), files read whole with a size limit, and durable writes."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def file_in_the_way(path: Path) -> Path | None:
    """The nearest existing non-folder at path or above it (None when there is none): what stops path from
    becoming a folder, or a file from being written under it."""
    path = Path(path)
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


def input_file_problem(path: Path) -> str | None:
    """Why path cannot be read as a file, as the rest of a sentence that starts with the path: missing, a folder, or
    not a regular file (a device such as /dev/null, a pipe); None when it can."""
    path = Path(path)
    if not path.exists():
        return "does not exist"
    if path.is_dir():
        return "is a folder"
    if not path.is_file():
        return "is not a regular file"
    return None


JSON_LIMIT_BYTES = 256 * 2 ** 20  # far above any report, summary or manifest eftguard writes


def read_file_bytes(path: Path, limit_bytes: int = JSON_LIMIT_BYTES) -> bytes:
    """The bytes of a file eftguard reads whole (a report, a summary, a key, a certificate): an OSError naming the
    problem when it is not a regular file (a link to /dev/zero or a named pipe would be read forever) or is over
    limit_bytes."""
    path = Path(path)
    problem = input_file_problem(path)
    if problem is not None:
        raise OSError(f"{path} {problem}")
    with path.open("rb") as file:
        data = file.read(limit_bytes + 1)
    if len(data) > limit_bytes:
        raise OSError(f"{path} is over {limit_bytes} bytes")
    return data


def read_text_file(path: Path, limit_bytes: int = JSON_LIMIT_BYTES, errors: str = "strict") -> str:
    """read_file_bytes as UTF-8 text."""
    return read_file_bytes(path, limit_bytes).decode("utf-8", errors)


def output_file_problem(path: Path, what: str, makes_folders: bool = False) -> str | None:
    """Why `what` cannot be written to the file path (a folder, under a file, in a missing or read-only folder), as
    the rest of a sentence that starts with the path; None when it can. makes_folders: the writer creates missing
    folders, so a missing one is judged by the nearest folder above it that exists."""
    path = Path(path)
    if path.is_dir():
        return f"is a folder: give a file path for {what}"
    blocker = file_in_the_way(path.parent)
    if blocker is not None:
        return f"is under {blocker}, which is a file: give a path in a folder for {what}"
    if not makes_folders and not path.parent.is_dir():
        return f"is in {path.parent}, which does not exist: create that folder, or give a path in an existing one"
    reason = unwritable_reason(path.parent)
    if reason is not None:
        return f"is in {path.parent}, which is not writable ({reason}): give a path in a folder you can write to"
    return None


def unwritable_reason(folder: Path) -> str | None:
    """Why no file can be created in folder, in the system's words; None when one can. A folder yet to be made is
    judged by the nearest one above it that exists. Found by creating and removing a file: os.access says yes to
    root in a read-only folder, and in /proc."""
    folder = Path(folder).absolute()
    try:
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".eftguard-write-check-"):
            pass
    except OSError as error:
        return error.strerror or str(error)
    return None


def fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(folder: Path) -> list[Path]:
    """mkdir -p, making each new folder's entry durable in its parent. Returns the folders this call made, outermost
    first: one that another process made meanwhile is not among them."""
    if folder.is_dir():
        return []
    made = make_dirs(folder.parent)
    try:
        folder.mkdir()
    except FileExistsError:
        if not folder.is_dir():
            raise
        return made
    fsync_dir(folder.parent)
    return [*made, folder]


def atomic_write(path: Path, write) -> None:
    """Write to a temp file, fsync it, rename it over path and fsync the folder: after a power loss path holds
    the old or the new content, never a torn one, and a later write cannot overtake this one on disk."""
    make_dirs(path.parent)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C or a full disk mid-write: no torn temporary file stays behind
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
