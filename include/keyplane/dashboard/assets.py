"""The browser libraries the dashboard and the served Data Docs load, from this server only.

An SRE's dashboard must work where the API server cannot reach the internet
(an air-gapped deployment), so nothing is fetched from a CDN when a page
loads. The libraries are npm packages pinned in the repository's
``package.json`` / ``package-lock.json``; ``scripts/bootstrap`` installs them
with ``npm ci`` and calls :func:`install` (``python -m
keyplane.dashboard.assets``), which copies the files below into
``static/vendor/`` beside this module. The plugin serves that folder.

Great Expectations writes its Data Docs with ``<script>`` and ``<link>`` tags
pointing at CDNs (its templates in ``great_expectations/render/view/templates``)
and its logo at a public bucket. :func:`offline_data_doc` rewrites those
URLs, when a page is served, to the same libraries under ``static/vendor/``
and to the logo GX already copies into the site's ``static/images/``: the
site on disk stays as GX built it, and a rebuilt site needs no extra step.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

STATIC = Path(__file__).resolve().parent / "static"
"""The files the plugin serves at ``<prefix>/static/``: the page's own, and ``vendor/``."""

VENDOR = STATIC / "vendor"

FILES: dict[str, str] = {
    "echarts/echarts.min.js": "echarts/dist/echarts.min.js",
    "jquery/jquery.min.js": "jquery/dist/jquery.min.js",
    "popper/popper.min.js": "popper.js/dist/umd/popper.min.js",
    "bootstrap/bootstrap.min.js": "bootstrap/dist/js/bootstrap.min.js",
    "bootstrap/bootstrap.min.css": "bootstrap/dist/css/bootstrap.min.css",
    "bootstrap-dark/bootstrap-prefers-dark.css": (
        "@forevolve/bootstrap-dark/dist/css/bootstrap-prefers-dark.css"
    ),
    "bootstrap-table/bootstrap-table.min.js": "bootstrap-table/dist/bootstrap-table.min.js",
    "bootstrap-table/bootstrap-table.min.css": "bootstrap-table/dist/bootstrap-table.min.css",
    "bootstrap-table/filter-control.min.js": (
        "bootstrap-table/dist/extensions/filter-control/bootstrap-table-filter-control.min.js"
    ),
    "bootstrap-table/filter-control.min.css": (
        "bootstrap-table/dist/extensions/filter-control/bootstrap-table-filter-control.min.css"
    ),
    "bootstrap-datepicker/bootstrap-datepicker.min.js": (
        "bootstrap-datepicker/dist/js/bootstrap-datepicker.min.js"
    ),
    "bootstrap-datepicker/bootstrap-datepicker.min.css": (
        "bootstrap-datepicker/dist/css/bootstrap-datepicker.min.css"
    ),
    "vega/vega.min.js": "vega/build/vega.min.js",
    "vega/vega-lite.min.js": "vega-lite/build/vega-lite.min.js",
    "vega/vega-embed.min.js": "vega-embed/build/vega-embed.min.js",
    # The stylesheet loads its fonts from ../webfonts/, hence the two folders.
    "fontawesome/css/all.min.css": "@fortawesome/fontawesome-free/css/all.min.css",
}
"""Served file (under ``static/vendor/``) → its source under ``node_modules/``."""

FOLDERS: dict[str, str] = {
    "fontawesome/webfonts": "@fortawesome/fontawesome-free/webfonts",
}
"""Served folder → its source folder under ``node_modules/``, copied whole."""

CDN: dict[str, str] = {
    "https://cdn.jsdelivr.net/npm/vega@5": "vega/vega.min.js",
    "https://cdn.jsdelivr.net/npm/vega-lite@5": "vega/vega-lite.min.js",
    "https://cdn.jsdelivr.net/npm/vega-embed@6": "vega/vega-embed.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/font-awesome/6.6.0/css/all.min.css": (
        "fontawesome/css/all.min.css"
    ),
    "https://code.jquery.com/jquery-3.7.1.min.js": "jquery/jquery.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/popper.js/1.12.9/umd/popper.min.js": (
        "popper/popper.min.js"
    ),
    "https://stackpath.bootstrapcdn.com/bootstrap/4.3.1/js/bootstrap.min.js": (
        "bootstrap/bootstrap.min.js"
    ),
    "https://maxcdn.bootstrapcdn.com/bootstrap/4.3.1/css/bootstrap.min.css": (
        "bootstrap/bootstrap.min.css"
    ),
    "https://cdn.jsdelivr.net/npm/@forevolve/bootstrap-dark@1.1.0/dist/css/"
    "bootstrap-prefers-dark.css": "bootstrap-dark/bootstrap-prefers-dark.css",
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.js": (
        "bootstrap-table/bootstrap-table.min.js"
    ),
    "https://unpkg.com/bootstrap-table@1.19.1/dist/bootstrap-table.min.css": (
        "bootstrap-table/bootstrap-table.min.css"
    ),
    "https://unpkg.com/bootstrap-table@1.19.1/dist/extensions/filter-control/"
    "bootstrap-table-filter-control.min.js": "bootstrap-table/filter-control.min.js",
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/"
    "bootstrap-table-filter-control.min.css": "bootstrap-table/filter-control.min.css",
    "https://unpkg.com/bootstrap-table@1.19.0/dist/extensions/filter-control/"
    "bootstrap-table-filter-control.css": "bootstrap-table/filter-control.min.css",
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/js/"
    "bootstrap-datepicker.min.js": "bootstrap-datepicker/bootstrap-datepicker.min.js",
    "https://cdnjs.cloudflare.com/ajax/libs/bootstrap-datepicker/1.9.0/css/"
    "bootstrap-datepicker.min.css": "bootstrap-datepicker/bootstrap-datepicker.min.css",
}
"""A URL Great Expectations 1.x's Data Docs load → the served copy under ``static/vendor/``.

The integrity attributes GX adds to some tags hash the CDN's file; they are
dropped with the URL, as the served copy is a different build of the same
release (npm's popper.js 1.16.1 stands in for 1.12.9: bootstrap 4.3.1 needs
at least 1.14.7 on npm)."""

GX_IMAGES = "https://great-expectations-web-assets.s3.us-east-2.amazonaws.com/"
"""Where GX's navigation bar takes its logo from; the same images are in the site."""

_INTEGRITY = re.compile(r'\s+(integrity="[^"]*"|crossorigin="[^"]*")')
_GX_IMAGE = re.compile(re.escape(GX_IMAGES) + r"([A-Za-z0-9._-]+)(\?[^\"']*)?")
_ASSET = re.compile(r"""<(?:script|link|img)\b[^>]*?\b(?:src|href)\s*=\s*["']([^"']+)["']""", re.I)


class AssetsMissing(RuntimeError):
    """``npm ci`` has not installed a library the dashboard serves."""


def install(node_modules: Path, vendor: Path = VENDOR) -> int:
    """Copy :data:`FILES` and :data:`FOLDERS` from ``node_modules`` into ``vendor``.

    Idempotent: a file whose copy has the same size and is not older is
    skipped. Returns how many files were copied.
    """
    missing = [
        src for src in (*FILES.values(), *FOLDERS.values()) if not (node_modules / src).exists()
    ]
    if missing:
        raise AssetsMissing(f"not in {node_modules} (run npm ci): {', '.join(missing)}")
    pairs = [(node_modules / src, vendor / dest) for dest, src in FILES.items()]
    for dest, src in FOLDERS.items():
        pairs += [
            (path, vendor / dest / path.relative_to(node_modules / src))
            for path in sorted((node_modules / src).rglob("*"))
            if path.is_file()
        ]
    copied = 0
    for source, target in pairs:
        if target.is_file():
            here, there = source.stat(), target.stat()
            if here.st_size == there.st_size and there.st_mtime >= here.st_mtime:
                continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
        copied += 1
    return copied


def offline_data_doc(html: str, depth: int, vendor_url: str) -> str:
    """A Data Docs page with its CDN assets replaced by the served copies.

    ``depth`` is how many folders below the site's root the page lies (0 for
    ``index.html``), so the logo is found in the site's own
    ``static/images/``; ``vendor_url`` is the vendor folder's URL relative to
    the page. A CDN URL this table does not know is left as it is (and the
    tests, which scan every page GX builds, fail on it).
    """
    for url, local in CDN.items():
        html = html.replace(f'"{url}"', f'"{vendor_url}{local}"')
    html = _GX_IMAGE.sub(lambda m: "../" * depth + "static/images/" + m.group(1), html)
    return _INTEGRITY.sub("", html)


def static_file(relative: str, root: Path = STATIC) -> Path | None:
    """The file at ``relative`` under ``root``; None if absent or outside it (``..``, symlinks)."""
    try:
        base = root.resolve()
        target = (base / relative).resolve()
        if not target.is_relative_to(base) or not target.is_file():
            return None
    except (OSError, ValueError):
        return None
    return target


def remote_assets(html: str) -> list[str]:
    """The ``src``/``href`` of ``<script>``, ``<link>`` and ``<img>`` tags that leave the server."""
    return [url for url in _ASSET.findall(html) if re.match(r"(?:https?:)?//", url)]


def main(argv: list[str]) -> int:
    node_modules = Path(argv[0]) if argv else Path("node_modules")
    try:
        copied = install(node_modules)
    except AssetsMissing as error:
        print(f"dashboard assets: {error}", file=sys.stderr)
        return 1
    if copied:
        print(f"dashboard assets: {copied} files copied into {VENDOR}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
