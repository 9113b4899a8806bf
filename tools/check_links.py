"""Checks the internal links of a built HTML site: every target file and ``#anchor`` exists.

An internal link is an ``href`` (of ``<a>`` or ``<link>``) or a ``src`` (of ``<img>`` or
``<script>``) without a scheme (``http:``, ``mailto:``, ``data:``, ...) and not starting with
``//``. Its file, resolved against the page that holds it (``dir/`` means ``dir/index.html``),
must exist inside the site, and its fragment, if any, must be an ``id`` (or an ``<a name>``)
of that file. Nothing is fetched: external links are not checked. HTML files under
``_static/`` are the theme's template fragments, not pages, and are not read. Usage::

  python tools/check_links.py docs/_build/html    # exit 1 and one line per broken link
"""

from __future__ import annotations

import functools
import html.parser
import pathlib
import re
import sys
import urllib.parse

_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
_LINKS = {"a": "href", "link": "href", "area": "href", "img": "src", "script": "src",
          "iframe": "src", "source": "src"}


class _Page(html.parser.HTMLParser):
  """The anchors a page defines and the (line, link) pairs it holds."""

  def __init__(self):
    super().__init__(convert_charrefs=True)
    self.anchors: set[str] = set()
    self.links: list[tuple[int, str]] = []

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    for key in ("id",) + (("name",) if tag == "a" else ()):
      if attrs.get(key):
        self.anchors.add(attrs[key])
    target = attrs.get(_LINKS.get(tag, ""))
    if target is not None:
      self.links.append((self.getpos()[0], target))


@functools.lru_cache(maxsize=None)
def _parse(path: pathlib.Path) -> _Page:
  page = _Page()
  page.feed(path.read_text(encoding="utf-8", errors="replace"))
  return page


def _internal(link: str) -> bool:
  return bool(link) and not _SCHEME.match(link) and not link.startswith("//")


def _pages(root: pathlib.Path) -> list[pathlib.Path]:
  return sorted(p for p in root.rglob("*.html") if "_static" not in p.relative_to(root).parts)


def broken_links(site: str | pathlib.Path) -> list[str]:
  """``'page:line: link (why)'`` for each internal link of the site's pages that leads nowhere."""
  root = pathlib.Path(site).resolve()
  _parse.cache_clear()
  broken = []
  for page in _pages(root):
    for line, link in _parse(page).links:
      if not _internal(link):
        continue
      parts = urllib.parse.urlsplit(link)
      path = urllib.parse.unquote(parts.path)
      target = (page.parent / path).resolve() if path else page
      if target.is_dir() or path.endswith("/"):
        target = target / "index.html"
      where = f"{page.relative_to(root)}:{line}: {link}"
      if root not in target.parents and target != root:
        broken.append(f"{where} (outside the site)")
      elif not target.is_file():
        broken.append(f"{where} (no file {target.relative_to(root)})")
      elif parts.fragment and target.suffix == ".html":
        if urllib.parse.unquote(parts.fragment) not in _parse(target).anchors:
          broken.append(f"{where} (no anchor #{parts.fragment} in {target.relative_to(root)})")
  return broken


def main(argv: list[str]) -> int:
  if len(argv) != 1:
    print(__doc__, file=sys.stderr)
    return 2
  if not pathlib.Path(argv[0]).is_dir():
    print(f"check_links: {argv[0]} is not a directory (build the site first)", file=sys.stderr)
    return 2
  broken = broken_links(argv[0])
  for b in broken:
    print(b)
  pages = len(_pages(pathlib.Path(argv[0]).resolve()))
  print(f"check_links: {len(broken)} broken internal link(s) in {pages} pages of {argv[0]}",
        file=sys.stderr)
  return 1 if broken else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
