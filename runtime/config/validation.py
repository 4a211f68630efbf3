"""Strict pydantic field types and one-line validation messages, shared by the file schemas
(bench results, the demo bundle's manifest).

A violation reads `<json path> <problem>`: `runs[2].latency_s.p50 must be > 0 (got -1.0)`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, Strict, ValidationError

METHOD_PATTERN = r"^[a-z0-9][a-z0-9+_.-]*$"
SHA256_PATTERN = r"^[0-9a-f]{64}$"

# Strict: a boolean is not a number, 1.0 is not an integer, "1" is neither.
Count = Annotated[int, Strict(), Field(ge=0)]
PositiveInt = Annotated[int, Strict(), Field(ge=1)]
Number = Annotated[float, Strict()]
NonNegative = Annotated[float, Strict(), Field(ge=0)]
Positive = Annotated[float, Strict(), Field(gt=0)]
Unit = Annotated[float, Strict(), Field(ge=0, le=1)]
Text = Annotated[str, Strict(), Field(min_length=1)]
Bool = Annotated[bool, Strict()]


_MESSAGES = {
    "missing": "is missing", "extra_forbidden": "is not a known field; remove it",
    "float_type": "must be a number", "finite_number": "must be a number", "int_type": "must be an integer",
    "bool_type": "must be true or false", "string_type": "must be a non-empty string",
    "string_too_short": "must be a non-empty string", "list_type": "must be a list", "too_short": "must not be empty",
    "dict_type": "must be an object", "model_type": "must be an object",
    "greater_than": "must be > {gt:g} (got {input})", "greater_than_equal": "must be >= {ge:g} (got {input})",
    "less_than_equal": "must be <= {le:g} (got {input})", "literal_error": "must be one of {choices} (got {input!r})",
}
_PATTERNS = {METHOD_PATTERN: "a lowercase method name such as 'ar' or 'lantern++'",
             SHA256_PATTERN: "64 lowercase hex digits"}


def describe(err: ValidationError) -> str:
    """`<json path> <problem>` for the first error, e.g. `runs[2].latency_s.p50 must be > 0 (got -1.0)`."""
    first = err.errors(include_url=False)[0]
    kind, ctx = first["type"], first.get("ctx", {})
    path = ""
    for key in (*first["loc"], *([ctx["field"]] if ctx.get("field") else [])):
        path = path if key == "[key]" else join_path(path, key)
    if kind in ("schema", "value_error"):
        problem = ctx.get("problem") or str(ctx.get("error", first["msg"]))
    elif kind == "string_pattern_mismatch":
        problem = f"must be {_PATTERNS[ctx['pattern']]}"
    else:
        choices = str(ctx.get("expected", "")).replace("'", "").replace(" or ", ", ")
        problem = _MESSAGES.get(kind, first["msg"]).format(input=first["input"], choices=choices, **ctx)
    return f"{path} {problem}" if path else problem


def join_path(path: str, key: str | int) -> str:
    """`path` extended by a key (`.key`) or a list index (`[i]`)."""
    return f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
