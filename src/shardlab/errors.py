"""The one place user mistakes become one-line errors.

A ``UserError`` carries what went wrong and how to fix it; the CLI prints
``error: <message> (fix: <hint>)`` and exits with status 2, no traceback.
Anything else that escapes is a bug in shardlab and keeps its traceback.
"""

from __future__ import annotations

import sys


def say(line: str) -> None:
    """One line on stderr in one write: print() writes the text and its newline separately, so the lines of
    ranks sharing one stderr could run together."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


class UserError(Exception):
    """A mistake in the user's input or environment, with the fix."""

    exit_code = 2

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message.rstrip(".")
        self.hint = hint

    def __str__(self) -> str:
        one_line = self.message.replace("\n", " ")
        if self.hint:
            return f"{one_line} (fix: {self.hint.replace(chr(10), ' ')})"
        return one_line


class OutOfMemory(UserError):
    """CUDA ran out of memory; reported with the peak and the next thing to try."""

    exit_code = 3
