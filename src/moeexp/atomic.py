"""Atomic file writes: a reader never sees a half-written file, a crash never loses the old one.

A write that fails for lack of room or rights (disk full, quota, file-size limit, read-only
or unwritable directory, a path under a file) raises :class:`~moeexp.errors.StorageError`
naming the file; the temporary file is removed and the old file, if any, is untouched.
"""

from __future__ import annotations

import errno
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from moeexp.errors import StorageError

#: errno values that mean "this cannot be written here", reported as StorageError.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EROFS,
                            errno.EACCES, errno.EPERM, errno.ENOTDIR, errno.EEXIST})


def storage_error(path: str | Path, exc: OSError) -> StorageError:
    """A StorageError naming ``path`` for an OSError of :data:`STORAGE_ERRNOS`."""
    hint = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted",
            errno.EFBIG: "the file exceeds a file-size limit (ulimit -f) or the file system's",
            errno.ENOTDIR: "a component of the path is a file, not a directory",
            errno.EEXIST: "a component of the path is a file, not a directory"}.get(
        exc.errno or 0, "the directory is not writable")
    return StorageError(f"cannot write {path}: {exc.strerror or exc} ({hint}); nothing was "
                        "replaced: an older version of the file, if any, is intact")


@contextmanager
def atomic_path(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path in ``path``'s directory; rename it onto ``path`` on success.

    ``suffix`` is kept on the temporary name (numpy appends ``.npz`` otherwise).

    Raises:
        StorageError: the directory cannot be created or written, or the disk is full.
    """
    path = Path(path)
    tmp_path: Path | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{suffix}",
                                   dir=path.parent)
        os.close(fd)
        tmp_path = Path(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_path, 0o666 & ~umask)  # mkstemp creates 0600; give the usual file mode
        yield tmp_path
        os.replace(tmp_path, path)
    except OSError as exc:
        if isinstance(exc, StorageError) or exc.errno not in STORAGE_ERRNOS:
            raise
        raise storage_error(path, exc) from exc
    finally:
        if tmp_path is not None and tmp_path.exists():
            tmp_path.unlink()


def write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``path`` atomically."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def write_with(path: str | Path, writer: Callable[[IO[bytes]], None]) -> None:
    """Call ``writer`` on a binary file handle, then move it onto ``path`` atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as fh:
        writer(fh)
        fh.flush()
        os.fsync(fh.fileno())
