"""mkdocs hook: the site's home page is the README (its sections up to "Layout"), with links
into docs/ rewritten relative to the site, so the two never drift apart. docs/index.md is a
placeholder whose text the hook replaces."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent / "README.md"
STOP = "\n## Layout"


def readme_home() -> str:
    """The README's head and documentation table as the site's home page."""
    text = README.read_text(encoding="utf-8").split(STOP, 1)[0]
    return re.sub(r"\]\(docs/", "](", text).rstrip() + "\n"


def on_page_read_source(page, config):  # noqa: ARG001 - mkdocs hook signature
    if page.file.src_uri == "index.md":
        return readme_home()
    return None
