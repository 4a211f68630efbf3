"""The report's building blocks: headings, paragraphs, tables, figures, and a loaded bench file."""


from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from runtime.bench.schema import (
    BenchResult,
)

if TYPE_CHECKING:

    pass



REPORT_MD = "report.md"
REPORT_HTML = "report.html"
PLOTS_DIR = "plots"  # figures, beside report.md
TABLES_DIR = "tables"  # every table as CSV


@dataclass
class Heading:
    level: int
    text: str


@dataclass
class Paragraph:
    text: str


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]


@dataclass
class Figure:
    """A rendered plot: `name` is its file stem under `plots/`, `png` and `svg` the image bytes."""

    name: str
    png: bytes
    caption: str
    svg: bytes = b""


Rendered = tuple[bytes, bytes]  # (png, svg) of one plot


def figure(name: str, rendered: Rendered, caption: str) -> Figure:
    return Figure(name, rendered[0], caption, rendered[1])


Block = Union[Heading, Paragraph, Table, Figure]


@dataclass
class BenchFile:
    """A loaded bench file and how the report names it."""

    path: str
    result: BenchResult
    label: str = ""
