"""`python -m runtime.serve.schema --out docs/reference/openapi.json`: the server's OpenAPI schema
(routes and request / response models; no model is loaded), committed so clients can be generated
without running a server. `tests/test_serve.py` checks it against a running server's."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace


def openapi_schema() -> dict[str, object]:
    """The schema, its version field normalised to "VERSION" (it is the package's version)."""
    from runtime.serve.api import create_app

    engine = SimpleNamespace(ready=None, decoder=None, stats=None, queue_depth=0, on_done=None)
    served = SimpleNamespace(version="VERSION", method="-", names=["-"], in_flight=0)
    schema: dict[str, object] = create_app(engine, served).openapi()  # type: ignore[arg-type]
    return schema


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the OpenAPI schema of runtime serve.")
    parser.add_argument("--out", type=Path, help="file to write (default: standard output)")
    args = parser.parse_args(argv)
    text = json.dumps(openapi_schema(), indent=2, sort_keys=True) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
