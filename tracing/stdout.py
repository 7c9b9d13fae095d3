"""What the `continuum trace` commands print, written so that a reader closing the pipe
early (`continuum trace summarize FILE | head`) ends the command quietly."""

from __future__ import annotations

import os
import sys

# A shell's status for a command that a closed pipe stopped (128 + SIGPIPE).
PIPE_CLOSED_STATUS = 141


def print_report(text: str) -> int:
    """Prints `text` and flushes stdout: 0, or `PIPE_CLOSED_STATUS` when the reader has closed
    the pipe. stdout is then pointed at the null device, so that the interpreter's last flush
    at exit does not report the closed pipe either."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
        return PIPE_CLOSED_STATUS
    return 0
