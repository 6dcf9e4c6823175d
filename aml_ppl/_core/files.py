r"""Files written whole or not at all: a half-written file never replaces a good one."""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator

from aml_ppl.errors import InputDataError


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    r"""A temporary path in ``path``'s folder (same suffix, for writers that read it) that the
    block writes; when the block ends without an error the file is flushed to disk and
    renamed over ``path`` (atomic on POSIX), else removed. A process killed at any moment
    leaves the old file or the new one, never a part of either.

    Raises:
        InputDataError: If the folder does not exist.

    Example:
        >>> import tempfile, pathlib
        >>> target = pathlib.Path(tempfile.mkdtemp()) / "note.txt"
        >>> with atomic_path(target) as temporary:
        ...     _ = temporary.write_text("whole")
        >>> target.read_text()
        'whole'
    """
    path = Path(path)
    folder = path.parent
    if not folder.is_dir():
        raise InputDataError(f"folder `{folder}/` does not exist; create it before writing `{path.name}`.")
    descriptor, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".partial{path.suffix}", dir=folder)
    os.close(descriptor)
    temporary = Path(name)
    try:
        yield temporary
        with open(temporary, "rb+") as file:
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    directory = os.open(folder, os.O_RDONLY)
    try:  # the rename itself reaches the disk
        os.fsync(directory)
    finally:
        os.close(directory)


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], object]) -> Path:
    r"""Write ``path`` whole or not at all (:func:`atomic_path`): ``write`` gets the open
    binary file and writes the whole content. Returns ``path`` as a ``Path``."""
    with atomic_path(path) as temporary, open(temporary, "wb") as file:
        write(file)
    return Path(path)
