"""An estimator's learned state in a JSON file: saved atomically, read with a size limit.

The file is the state's JSON object with `"format": STATE_FORMAT` first, by which a later
save recognises it: a save replaces only such a file (or one saved before the marker, or an
empty one), so that a setting pointed by mistake at another file never destroys it
(`check_state_path`, also run when the policy's options are read)."""

from __future__ import annotations

import json
import logging
import os
import stat
import tempfile
from pathlib import Path

from estimator.ttl_estimator import TTLEstimator
from tracing.files import check_replaceable

logger = logging.getLogger(__name__)

DEFAULT_MAX_STATE_BYTES = 64 * 1024 * 1024
_READ_CHUNK_BYTES = 1 << 20
STATE_FORMAT = "continuum-estimator-state"
# How a state file begins: with the marker, or, saved before it, with Eq. 2's version.
STATE_FILE_PREFIXES = (b'{"format": "' + STATE_FORMAT.encode() + b'"',
                       b'{"version": 1, "cold_start_samples": ')


def check_state_path(path: str | Path) -> None:
    """ValueError unless a state may be saved at `path`: it does not exist (its folder
    does), is empty, or holds a saved state (`tracing.files.check_replaceable`)."""
    check_replaceable(path, setting="estimator_state", own_prefixes=STATE_FILE_PREFIXES)


def save_state(estimator: TTLEstimator, path: str | Path) -> bool:
    """Writes `estimator.state()` as JSON marked with `STATE_FORMAT`, atomically (a synced
    temporary file, then a rename); False, writing nothing, if the estimator keeps no state.
    ValueError, writing nothing, if `path` holds a file that is not a saved state
    (`check_state_path`); OSError if the file cannot be written."""
    state = estimator.state()
    if state is None:
        return False
    path = Path(path)
    check_state_path(path)
    text = json.dumps({"format": STATE_FORMAT, **state})
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        Path(temporary).replace(path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return True


def read_state(path: str | Path, max_bytes: int = DEFAULT_MAX_STATE_BYTES) -> object:
    """The JSON data of a state file (without its `format` marker); ValueError if it is not
    a regular file (a device, a FIFO, a directory: refused without reading), is larger than
    `max_bytes`, or is not JSON. At most `max_bytes` + 1 bytes are ever read."""
    path = Path(path)
    try:
        data = _read_regular_file(path, max_bytes)
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error}") from error
    try:
        state = json.loads(data)
    except (ValueError, RecursionError) as error:
        raise ValueError(f"{path} is not JSON: {error}") from error
    if isinstance(state, dict) and state.get("format") == STATE_FORMAT:
        del state["format"]
    return state


def _read_regular_file(path: Path, max_bytes: int) -> bytes:
    # Opened without blocking (a FIFO with no writer would block open()), then checked on the
    # open descriptor, so the file checked is the file read.
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise ValueError(f"{path} is not a regular file")
        if status.st_size > max_bytes:
            raise ValueError(f"{path} is larger than {max_bytes} bytes")
        chunks: list[bytes] = []
        num_left = max_bytes + 1
        while num_left > 0:
            chunk = os.read(descriptor, min(num_left, _READ_CHUNK_BYTES))
            if not chunk:
                break
            chunks.append(chunk)
            num_left -= len(chunk)
    finally:
        os.close(descriptor)
    if num_left <= 0:  # it grew after the check
        raise ValueError(f"{path} is larger than {max_bytes} bytes")
    return b"".join(chunks)


def load_state_or_cold_start(
    estimator: TTLEstimator, path: str | Path, max_bytes: int = DEFAULT_MAX_STATE_BYTES
) -> bool:
    """Loads the state file into the estimator; True if it did. A missing file is a cold
    start; an unreadable, oversized or invalid one too, with a warning (and no change)."""
    if not os.path.lexists(path):
        return False
    try:
        estimator.load_state(read_state(path, max_bytes))
    except ValueError as error:
        logger.warning("estimator state %s ignored, starting cold: %s", path, error)
        return False
    return True
