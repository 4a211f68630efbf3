"""The web page of `runtime serve`: plain HTML, CSS and JavaScript files shipped in the package
(runtime/serve/static/), served at / and /ui/<file>; nothing is loaded from elsewhere (the
Content-Security-Policy says so to the browser). Every URL in the page is relative, so it works
behind a proxy that serves the server under a prefix (--root-path), opened at the prefix with its
trailing slash. The page reads GET /info, then streams POST /v1/images/generations."""

from __future__ import annotations

from importlib import resources
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import FastAPI

# the page's files and their media types; nothing else is served from the folder
PAGE_FILES = {"index.html": "text/html; charset=utf-8", "page.js": "text/javascript; charset=utf-8",
              "page.css": "text/css; charset=utf-8"}
# same-origin scripts, styles and requests; images from the answers' data: URLs; nothing inline
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def page_files() -> dict[str, bytes]:
    """{name: bytes} of the page's files, read from the installed package."""
    folder = resources.files("runtime.serve") / "static"
    return {name: (folder / name).read_bytes() for name in PAGE_FILES}


def add_page(app: FastAPI) -> None:
    """GET / (the page) and GET /ui/{name} (its script and style sheet) on `app`; kept out of the
    OpenAPI schema (they are no API). The files are read once, here."""
    from fastapi.responses import Response
    from starlette.exceptions import HTTPException

    files = page_files()
    headers = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
               "Cache-Control": "no-cache"}

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return Response(files["index.html"], media_type=PAGE_FILES["index.html"], headers=headers)

    @app.get("/ui/{name}", include_in_schema=False)
    async def page_file(name: str) -> Response:
        if name == "index.html" or name not in files:
            raise HTTPException(404)
        return Response(files[name], media_type=PAGE_FILES[name], headers=headers)
