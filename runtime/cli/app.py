"""The `runtime` command line: one Typer app; each sub-command lives in its own module.

Every module in `COMMAND_MODULES` registers its commands on `app` when imported. A
`UserError` raised anywhere below is printed as one line (no traceback) and exits 2.
"""

from __future__ import annotations

import importlib
import logging
import sys

import typer

app = typer.Typer(
    name="runtime",
    help="lantern-runtime: fast visual AR image generation with LANTERN++ speculative decoding.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

LOG_LEVELS = {-1: logging.ERROR, 0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}


def configure_logging(verbosity: int, log_format: str = "auto") -> None:
    """Route the standard `logging` records of `runtime`, `backends` and `profiles` (and uvicorn's,
    at warnings and above) to stderr: -q (verbosity -1) errors only, default warnings, -v info
    (device, profile, model loaded; the server's access log), -vv debug (resolved method settings,
    ...). `log_format` (runtime.utils.log_format): rich on a terminal, else one line per record, plain or
    JSON. Idempotent."""
    from runtime.utils.log_format import make_handler

    handler = make_handler(log_format, verbosity)
    level = LOG_LEVELS[max(-1, min(2, verbosity))]
    for name in ("runtime", "backends", "profiles", "uvicorn"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(max(level, logging.WARNING) if name == "uvicorn" else level)
        logger.propagate = False


def _print_version(value: bool) -> None:
    if value:
        from runtime import __version__

        print(f"lantern-runtime {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    verbose: int = typer.Option(0, "--verbose", "-v", count=True,
                                help="More log lines on stderr: -v what was loaded and where, -vv debug."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Errors only (no warnings)."),
    version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                 help="Print the lantern-runtime version and exit."),
    log_format: str = typer.Option("auto", "--log-format", envvar="LANTERN_LOG_FORMAT", show_envvar=True,
                                   help="How log lines are written to stderr: rich (a terminal's), plain (one "
                                   "line per record, UTC time first), json (one object per line, for a log "
                                   "collector), or auto (rich on a terminal, plain elsewhere)."),
    commit: str = typer.Option(None, "--commit", help="The git commit to record in result files (default: "
                               "$LANTERN_COMMIT, else the checkout's HEAD where one is found)."),
) -> None:
    """lantern-runtime: fast visual AR image generation with LANTERN++ speculative decoding."""
    import os
    import re

    from runtime.utils.errors import UserError

    from runtime.utils.log_format import LOG_FORMATS

    if verbose and quiet:
        raise UserError("-v/--verbose and -q/--quiet contradict each other; give one")
    if log_format not in LOG_FORMATS:
        raise UserError(f"--log-format / LANTERN_LOG_FORMAT {log_format!r}: choose {', '.join(LOG_FORMATS)}")
    if commit is not None:
        if not re.fullmatch(r"[0-9a-f]{7,40}(-dirty)?", commit):
            raise UserError(f"--commit {commit!r}: expected a git commit hash (7 to 40 hex digits)")
        os.environ["LANTERN_COMMIT"] = commit  # runtime.bench.environment.COMMIT_ENV
    configure_logging(-1 if quiet else verbose, log_format)


# Sub-command modules, imported for their side effect of registering on `app`.
COMMAND_MODULES: list[str] = [
    "runtime.cli.report_cmd",
    "runtime.cli.models_cmd",
    "runtime.cli.devices_cmd",
    "runtime.cli.run_cmd",
    "runtime.cli.sample_cmd",
    "runtime.cli.train_cmd",
    "runtime.cli.eval_cmd",
    "runtime.cli.bench_cmd",
    "runtime.cli.selfcheck_cmd",
    "runtime.cli.tune_cmd",
    "runtime.cli.serve_cmd",
]


def _register() -> None:
    for module in COMMAND_MODULES:
        importlib.import_module(module)


# The command line of the current invocation, recorded in result files.
INVOCATION: list[str] = []


class Interrupted(BaseException):
    """A stop signal (SIGINT / SIGTERM / SIGHUP) raised where the program is, so every `finally`
    (staging folders, process groups) runs on the way out. Not an Exception: nothing catches it by
    accident; not a KeyboardInterrupt: click would turn it into a signal-less Abort."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_interrupted(signum: int, frame: object) -> None:  # noqa: ARG001 - signal handler signature
    raise Interrupted(signum)


def install_stop_handlers() -> None:
    """SIGINT, SIGTERM and SIGHUP raise `Interrupted` (also when the parent started this process
    with SIGINT ignored, as a shell does for background jobs). Main thread only."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return
    for name in ("SIGINT", "SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), _raise_interrupted)


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point. Exit codes: 0 everything reported was done; 1 a check failed;
    2 bad input; 128 + N stopped by signal N (130 SIGINT, 143 SIGTERM, 129 SIGHUP)."""
    import signal

    from runtime.utils.errors import UserError

    INVOCATION[:] = ["runtime"] + list(sys.argv[1:] if argv is None else argv)
    _register()
    previous = {name: signal.getsignal(getattr(signal, name)) for name in ("SIGINT", "SIGTERM", "SIGHUP")
                if hasattr(signal, name)}
    install_stop_handlers()
    try:
        # non-standalone mode returns typer.Exit's code instead of exiting with it
        code = app(args=argv, standalone_mode=False)
        if isinstance(code, int) and code != 0:
            raise SystemExit(code)
    except Interrupted as stop:
        name = signal.Signals(stop.signum).name
        print(f"interrupted by {name}: stopped; nothing half-written was left", file=sys.stderr)
        raise SystemExit(128 + stop.signum) from None
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except SystemExit:
        raise
    except Exception as err:
        # Usage errors arrive here in non-standalone mode. typer may vendor its own click, so
        # recognise them by shape (show + exit_code) rather than by class.
        if hasattr(err, "show") and isinstance(getattr(err, "exit_code", None), int):
            err.show()
            raise SystemExit(err.exit_code) from None
        if type(err).__name__ == "Abort":
            print("aborted", file=sys.stderr)
            raise SystemExit(130) from None
        raise
    finally:
        for name, handler in previous.items():  # in-process callers (tests) get theirs back
            if handler is not None:
                signal.signal(getattr(signal, name), handler)


if __name__ == "__main__":
    main()
