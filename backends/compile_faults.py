"""What a failed graph-mode compile means to the user, and what the compilers log meanwhile.

A compile fails for reasons the user can fix (a full disk, a file size limit, a read-only cache, a
broken C++ toolchain) wrapped in the compilers' own errors; :func:`compile_fault` finds the cause
and words it as one line. While a step compiles, :func:`held_compiler_logs` holds what torch logs
(inductor logs its own ``Failed to load artifact`` error before raising), so a fault that becomes
one line is that line alone; anything else is handed to torch's handlers unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from collections.abc import Callable, Iterator

_FILE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT})


def compile_fault(err: BaseException, name: str) -> str | None:
    """The one-line message for compiling step `name` failing with `err`, or None where `err`
    is not the user's to fix (a compiler bug: let it raise as it is)."""
    fault, broken = _file_fault(err), _compiler_error(err)
    reason = (fault.strerror or str(fault)) if fault is not None else None
    if reason is None and broken is not None and "File size limit exceeded" in broken:
        reason = f"{os.strerror(errno.EFBIG)}: {broken}"  # the compiler itself hit ulimit -f
    elif reason is None and broken is not None and os.strerror(errno.ENOSPC) in broken:
        reason = broken
    if reason is not None:
        where = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or "the compiler's cache"
        return (f"graph mode: compiling step {name} could not write its kernels to {where} ({reason}); "
                "free some space or raise the file size limit (ulimit -f), or pass --no-graph")
    if broken is not None:
        return (f"graph mode: the C++ compiler failed on step {name} ({broken}); fix the toolchain "
                "(g++ or clang++ and Python's headers), or pass --no-graph")
    return None


@contextlib.contextmanager
def held_compiler_logs() -> Iterator[Callable[[], None]]:
    """Hold every record torch's loggers would write while the block runs; yields `release`,
    which hands the records held so far to their handlers, in order, and stops holding.

    Records never released are dropped: call `release` on every path except the one that replaces
    the compilers' account of a fault with one line of its own.
    """
    held: list[tuple[logging.Handler, logging.LogRecord]] = []
    hooks: list[tuple[logging.Handler, Callable[[logging.LogRecord], bool]]] = []
    for logger_name, logger in list(logging.Logger.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or logger_name.split(".")[0] != "torch":
            continue
        for handler in logger.handlers:
            def hold(record: logging.LogRecord, handler: logging.Handler = handler) -> bool:
                held.append((handler, record))
                return False

            handler.addFilter(hold)
            hooks.append((handler, hold))

    def unhook() -> None:
        for handler, hook in hooks:
            handler.removeFilter(hook)
        hooks.clear()

    def release() -> None:
        unhook()
        for handler, record in held:
            handler.handle(record)
        held.clear()

    try:
        yield release
    finally:
        unhook()


def _causes(err: BaseException) -> Iterator[BaseException]:
    """`err`, then its chain of causes (each once)."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _file_fault(err: BaseException) -> OSError | None:
    """The OSError of a full disk, a file size limit, a read-only or forbidden folder anywhere in
    `err`'s chain of causes, or None."""
    return next((c for c in _causes(err) if isinstance(c, OSError) and c.errno in _FILE_ERRNOS), None)


def _compiler_error(err: BaseException) -> str | None:
    """The last `error:` line of a C++ compiler failure (inductor's CppCompileError), or the first
    line of its "no working compiler" error, anywhere in `err`'s chain of causes; else None."""
    for cause in _causes(err):
        if type(cause).__name__ in ("CppCompileError", "InvalidCxxCompiler"):
            lines = [line.strip() for line in str(cause).splitlines() if line.strip()]
            errors = [line for line in lines if "error:" in line.lower()]
            return ((errors or lines or ["C++ compile error"])[-1 if errors else 0])[:300]
    return None
