"""User-facing errors.

Every problem caused by the user's input (a missing checkpoint, a malformed profile, an
unknown device) is raised as :class:`UserError` with a one-line message that names the
problem and the fix. The CLI prints the message alone, without a traceback, and exits 2.
"""

from __future__ import annotations

import lzma
import struct
import tokenize
import zipfile
import zlib
from collections.abc import Iterable

# What reading a damaged or hostile file can raise: an .npz's zip structure (bad headers or
# checksums; encrypted, patched or unknown compression: RuntimeError / NotImplementedError), its
# deflate, bzip2 or lzma stream, an .npy header (numpy parses it as Python: ValueError,
# SyntaxError, tokenize.TokenError), a missing member, a header whose shape asks for more memory
# than there is; an image PIL cannot decode (OSError, a text chunk past its limit: ValueError,
# "broken PNG file": SyntaxError). A reader of such a file turns these into one UserError line.
FILE_FAULTS: tuple[type[BaseException], ...] = (
    OSError, EOFError, ValueError, KeyError, SyntaxError, RuntimeError, MemoryError, tokenize.TokenError,
    zipfile.BadZipFile, zlib.error, lzma.LZMAError, struct.error)


class UserError(Exception):
    """A problem with the user's input, reported as one line naming the problem and the fix."""

    def __init__(self, message: str) -> None:
        if "\n" in message:
            message = " ".join(part.strip() for part in message.splitlines() if part.strip())
        super().__init__(message)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """The suffix " (did you mean 'x'?)" naming the closest of `choices` to a mistyped `name`, else ""."""
    import difflib

    options = list(choices)
    lowered = {c.lower(): c for c in options}
    close = difflib.get_close_matches(str(name).lower(), list(lowered), n=1, cutoff=0.6)
    return f" (did you mean {lowered[close[0]]!r}?)" if close else ""

