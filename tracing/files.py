"""The rule for every file the engine writes over (a trace, an estimator's saved state): it
replaces only a file it could have written itself, recognised by how that file begins, so
that a setting pointed by mistake at another file (a config, a key) is refused at start-up
instead of destroying it. Standard library only: the lowest layer, used by the config
classes, the tracer and the estimator alike.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

# How much of an existing file is read to recognise it.
_HEAD_BYTES = 256


def check_replaceable(path: str | os.PathLike[str], *, setting: str,
                      own_prefixes: Sequence[bytes], devices: bool = False,
                      folder_may_be_made: bool = False) -> None:
    """ValueError, naming `setting`, unless the engine may write `path` by replacing it:
    it does not exist and its folder does, or it is an empty regular file, or a regular file
    that begins with one of `own_prefixes` (what the engine's own files of this kind begin
    with), or, with `devices` (for a file written in place, never renamed over), a
    character device such as `/dev/null`. Anything else (a folder, a FIFO, a device) is
    refused without being opened for reading. With `folder_may_be_made` (a setting checked
    before the run that makes its folder), a missing folder passes."""
    path = Path(path)
    if not os.path.lexists(path):
        if not folder_may_be_made and not path.parent.is_dir():
            raise ValueError(f"{setting}: the folder of {str(path)!r} does not exist")
        return
    try:
        status = path.stat()
    except OSError as error:
        raise ValueError(f"{setting}: cannot read {str(path)!r}: {error}") from error
    if devices and stat.S_ISCHR(status.st_mode):
        return
    if not stat.S_ISREG(status.st_mode):
        raise ValueError(f"{setting}: {str(path)!r} is not a regular file")
    if status.st_size == 0:
        return
    try:
        with path.open("rb") as file:
            head = file.read(_HEAD_BYTES)
    except OSError as error:
        raise ValueError(f"{setting}: cannot read {str(path)!r}: {error}") from error
    if not any(head.startswith(prefix) for prefix in own_prefixes):
        raise ValueError(f"{setting}: {str(path)!r} exists and is not a file the engine wrote; "
                         "refusing to overwrite it (move it, or name another path)")
