"""User-facing errors.

Every problem caused by the user's input (a missing checkpoint, a malformed profile, an
unknown device) is raised as :class:`UserError` with a one-line message that names the
problem and the fix. The CLI prints the message alone, without a traceback, and exits 2.
"""


class UserError(Exception):
    """A problem with the user's input, reported as one line naming the problem and the fix."""

    def __init__(self, message: str) -> None:
        if "\n" in message:
            message = " ".join(part.strip() for part in message.splitlines() if part.strip())
        super().__init__(message)
