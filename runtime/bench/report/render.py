"""Rendering the blocks: markdown, self-contained HTML, and every table as numeric CSV."""


from __future__ import annotations

import base64
import html
import io
import re
from typing import TYPE_CHECKING, Sequence

from runtime.bench.report.blocks import PLOTS_DIR, Block, Heading, Paragraph, Table

if TYPE_CHECKING:

    pass



def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(blocks: Sequence[Block]) -> str:
    """Markdown with figures linked as `plots/<name>.png`."""
    out: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"{'#' * block.level} {block.text}")
        elif isinstance(block, Paragraph):
            out.append(block.text)
        elif isinstance(block, Table):
            lines = ["| " + " | ".join(_md_cell(h) for h in block.headers) + " |"]
            lines.append("|" + "|".join("---" for _ in block.headers) + "|")
            lines.extend("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows)
            out.append("\n".join(lines))
        else:
            out.append(f"![{block.caption}]({PLOTS_DIR}/{block.name}.png)")
    return "\n\n".join(out) + "\n"


_CSS = (
    "body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:1em 0;font-size:0.9em}"
    "th,td{border:1px solid #ccc;padding:3px 8px;text-align:left}th{background:#f3f3f3}"
    "img{max-width:100%}code{background:#f3f3f3;padding:0 3px}figcaption{font-size:0.85em;color:#555}"
    # a table wider than the page scrolls inside its own box; long words and code spans wrap
    ".wide{overflow-x:auto}p,h1,h2,h3,figcaption{overflow-wrap:anywhere}"
)


def _inline(text: str) -> str:
    """HTML-escape and turn `code` spans into <code>."""
    parts = html.escape(text, quote=False).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))


def render_html(blocks: Sequence[Block]) -> str:
    """One self-contained HTML page: inline CSS, figures as `data:image/png;base64` URIs."""
    title = next((b.text for b in blocks if isinstance(b, Heading)), "bench report")
    out = [
        "<!DOCTYPE html>",
        f'<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>',
        f"<style>{_CSS}</style></head><body>",
    ]
    for block in blocks:
        if isinstance(block, Heading):
            out.append(f"<h{block.level}>{_inline(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            out.append(f"<p>{_inline(block.text)}</p>")
        elif isinstance(block, Table):
            head = "".join(f"<th>{_inline(h)}</th>" for h in block.headers)
            body = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in block.rows)
            out.append(f'<div class="wide"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>')
        else:
            data = base64.b64encode(block.png).decode("ascii")
            out.append(
                f'<figure><img alt="{html.escape(block.caption)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{_inline(block.caption)}</figcaption></figure>"
            )
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def table_files(blocks: Sequence[Block]) -> list[tuple[str, Table]]:
    """(file name, table) for every table: `NN-<heading slug>.csv`, NN counting in page order."""
    import re

    out, heading = [], "report"
    for block in blocks:
        if isinstance(block, Heading):
            heading = re.sub(r"[^a-z0-9]+", "-", block.text.lower()).strip("-")[:48] or "section"
        elif isinstance(block, Table):
            out.append((f"{len(out) + 1:02d}-{heading}.csv", block))
    return out


_INTERVAL_CELL = re.compile(r"^(-?[\d.]+)x? \[(-?[\d.]+), (-?[\d.]+)\]$")


_NUMBER_CELL = re.compile(r"^(-?[\d.]+)x$")


def table_csv(table: Table) -> str:
    """The table as CSV with numbers as numbers: a column holding "1.54x [1.26, 1.81]" cells becomes
    three, `<header>` / `<header> low` / `<header> high`; a "1.54x" cell is 1.54; markdown code
    marks are dropped; other cells are kept as text."""
    import csv

    cells = [[cell.replace("`", "") for cell in row] for row in table.rows]
    split = [any(_INTERVAL_CELL.match(row[j]) for row in cells) for j in range(len(table.headers))]
    headers: list[str] = []
    for j, name in enumerate(table.headers):
        base = name.replace(" [95% CI]", "")
        headers.extend([base, f"{base} low", f"{base} high"] if split[j] else [name])
    rows = []
    for row in cells:
        out: list[str] = []
        for j, cell in enumerate(row):
            interval, number = _INTERVAL_CELL.match(cell), _NUMBER_CELL.match(cell)
            if split[j]:
                out.extend(interval.groups() if interval else [number.group(1) if number else cell, "", ""])
            else:
                out.append(number.group(1) if number else cell)
        rows.append(out)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(headers)
    writer.writerows(rows)
    return buffer.getvalue()
