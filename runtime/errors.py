"""User-facing errors: one clear line, exit status 2, never a traceback."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in user input (data, config, request, path), reported as one line naming the culprit.

    The CLI prints ``error: <message>`` to stderr and exits with status 2.
    """

    exit_code = 2

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message
