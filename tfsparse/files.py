"""Files written whole or not at all: a crash at any moment leaves the previous file loadable.

Every file tfsparse writes -- the Keras checkpoints of
:class:`tfsparse.keras.callbacks.ModelCheckpoint` and
:class:`tfsparse.keras.callbacks.BackupAndRestore`, the benchmarks' JSON and figures -- is
written to a temporary file beside its destination (same directory, so the same file system;
its name ends like the destination's, so Keras and matplotlib pick the same format), flushed to
disk, and renamed over the destination only when complete (``os.replace``: atomic on POSIX).
A writer killed half-way leaves the old file untouched and a ``.tfsparse-partial-*`` file
that the next save overwrites.

:func:`check_saved_file` tells a truncated Keras file from a missing one (Keras says "File not
found" for both).  Standard library only (h5py, where it imports, for
``.h5`` files): every module may use it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import zipfile
from pathlib import Path

PARTIAL = ".tfsparse-partial-"
"""Prefix of the temporary file beside a destination while it is written."""


def partial_path(path) -> Path:
    """Where :func:`replacing` writes ``path`` before renaming it.

    Args:
      path: the destination.

    Returns:
      A :class:`~pathlib.Path` in the same directory, the name prefixed by :data:`PARTIAL` (so it
      keeps the destination's suffixes, ``.keras``, ``.weights.h5``, ``.png``).
    """
    path = Path(path)
    return path.with_name(PARTIAL + path.name)


#: What ``fsync`` answers on a file system that cannot flush (some network mounts, a directory
#: on some file systems): the write is not known to have failed, so the rename goes ahead.  Any
#: other error (EIO, ENOSPC, EDQUOT: a network file system may report a failed write-back only
#: here) means the content may not be on disk, so the destination is not replaced.
_FSYNC_UNSUPPORTED = frozenset(e for e in (errno.EINVAL, errno.ENOTSUP, getattr(errno, "EOPNOTSUPP", None),
                                           errno.EROFS, errno.EBADF) if e is not None)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _FSYNC_UNSUPPORTED:
            raise OSError(e.errno, f"{path} may not be on disk: fsync failed ({e.strerror})") from e
    finally:
        os.close(fd)


#: What a failed write-back looks like: the data may not be on disk.
_WRITE_FAILED = frozenset(e for e in (errno.EIO, errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e is not None)


def _fsync_directory(directory: Path) -> None:
    """Flushes the rename into ``directory`` to disk.  The new file is in place already: only a
    failed write-back (EIO, ENOSPC, EDQUOT) is an error; a directory this process cannot open, or a
    file system that cannot flush one, is not."""
    try:
        _fsync(directory)
    except OSError as e:
        if e.errno in _WRITE_FAILED:
            raise


@contextlib.contextmanager
def replacing(path):
    """Yields the temporary path to write ``path``'s new content to, then renames it over ``path``.

    When the block ends without an exception, the temporary file is flushed to disk and renamed
    over ``path`` (atomic), else removed and ``path`` is left as it was.  Should the flush fail
    (an I/O error, a full disk or quota: a network file system may report a failed write only
    then) the temporary file is removed and ``path`` is left as it was, and the error raised;
    a file system that cannot flush at all is not an error.  The directory is created if needed.

    Args:
      path: the destination.

    Yields:
      The temporary :class:`~pathlib.Path`.

    Raises:
      FileNotFoundError: the block wrote nothing to the temporary path.
      OSError: flushing the file failed (``path`` unchanged), or the directory's write-back failed
        (``path`` replaced, but the rename may not survive a crash of the machine).
    """
    path = Path(path)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = partial_path(path)
    try:
        yield tmp
        if not tmp.exists():
            raise FileNotFoundError(f"nothing was written to {tmp} (the temporary file of {path})")
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_directory(path.parent if path.parent != Path("") else Path("."))


def write_text(path, text: str) -> None:
    """Writes ``text`` to ``path`` atomically (:func:`replacing`).

    Args:
      path: the destination.
      text: the content.
    """
    with replacing(path) as tmp:
        Path(tmp).write_text(text)


def write_bytes(path, data: bytes) -> None:
    """Writes ``data`` to ``path`` atomically (:func:`replacing`).

    Args:
      path: the destination.
      data: the content.
    """
    with replacing(path) as tmp:
        Path(tmp).write_bytes(data)


def save_figure(fig, path, **kwargs) -> None:
    """Saves a matplotlib figure atomically (``fig.savefig``, :func:`replacing`).

    Args:
      fig: the figure.
      path: the destination (its suffix picks the format).
      **kwargs: passed to ``fig.savefig``.
    """
    with replacing(path) as tmp:
        fig.savefig(tmp, **kwargs)


class TruncatedFile(ValueError):
    """A saved file exists but is incomplete or not the format its name says."""


_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def check_saved_file(path) -> None:
    """Checks that a saved file is complete.

    A ``.keras`` file must be a readable zip archive, a ``.h5`` file an HDF5 file as long as its
    superblock says (checked with h5py where it imports).  Other names are not checked.

    Args:
      path: the file.

    Raises:
      FileNotFoundError: ``path`` does not exist.
      TruncatedFile: it is not a complete file of the format its name says.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist")
    size = path.stat().st_size
    if path.name.endswith(".keras"):
        try:
            with zipfile.ZipFile(path) as z:
                bad = z.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise TruncatedFile(f"{path} ({size} bytes) is not a complete .keras file ({e}): the save that wrote it "
                                f"was interrupted, or it is another kind of file") from None
        if bad is not None:
            raise TruncatedFile(f"{path} ({size} bytes) is damaged: its member {bad} does not match its checksum")
    elif path.name.endswith(".h5"):
        with open(path, "rb") as f:
            head = f.read(len(_HDF5_SIGNATURE))
        if head != _HDF5_SIGNATURE:
            raise TruncatedFile(f"{path} ({size} bytes) is not an HDF5 file: the save that wrote it was interrupted, "
                                f"or it is another kind of file")
        try:
            import h5py  # Keras' own reader of .h5 files; it compares the size with the superblock's
        except ImportError:
            return
        try:
            h5py.File(path, "r").close()
        except OSError as e:
            raise TruncatedFile(f"{path} ({size} bytes) is not a complete HDF5 file ({e}): the save that wrote it "
                                f"was interrupted") from None
