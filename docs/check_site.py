"""Checks a built documentation site: every page renders, every link lands.

Run after `mkdocs build` (the `docs` step of .ci/run):

    python docs/check_site.py site

For every HTML page of the site it checks that the page has a title and
content (an `<article>` with text), and that every link inside the site
points at a page that exists and, when it names an anchor (`#section`),
at an element of that page with that id. Links that leave the site
(`https:`, `mailto:`) are not followed: CI has no internet. Exits non-zero,
listing every broken link and empty page.
"""

import html.parser
import os
import posixpath
import sys
import urllib.parse


class _Page(html.parser.HTMLParser):
    """The ids, links, title and article text of one HTML page."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.title = ""
        self.article_text = 0
        self._in_title = False
        self._article_depth = 0

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if "id" in attributes:
            self.ids.add(attributes["id"])
        if tag == "a" and attributes.get("href"):
            self.links.append(attributes["href"])
        if tag == "title":
            self._in_title = True
        if tag == "article":
            self._article_depth += 1

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False
        if tag == "article":
            self._article_depth -= 1

    def handle_data(self, data):
        if self._in_title:
            self.title += data
        if self._article_depth > 0:
            self.article_text += len(data.strip())


def _parse(path):
    page = _Page()
    with open(path, encoding="utf-8") as handle:
        page.feed(handle.read())
    return page


def _target(site, page_path, href):
    """Returns the file and anchor a link inside the site points at.

    `None` for a link that leaves the site. A path from the root (`/api/`,
    as the 404 page links) starts at the site's root.
    """
    parsed = urllib.parse.urlparse(href)
    if parsed.scheme or parsed.netloc:
        return None
    base = site if parsed.path.startswith("/") else os.path.dirname(page_path)
    path = urllib.parse.unquote(parsed.path).lstrip("/")
    if parsed.path:
        target = os.path.normpath(os.path.join(base, path))
    else:
        target = page_path
    if os.path.isdir(target):
        target = os.path.join(target, "index.html")
    return target, urllib.parse.unquote(parsed.fragment)


def check(site):
    """Returns the list of problems found in the built site `site`."""
    pages = {}
    for directory, _, files in os.walk(site):
        for name in files:
            if name.endswith(".html"):
                path = os.path.normpath(os.path.join(directory, name))
                pages[path] = _parse(path)
    problems = []
    if not pages:
        problems.append(f"{site}: no HTML page")
    for path, page in sorted(pages.items()):
        shown = posixpath.relpath(path, site)
        if shown != "404.html" and (not page.title or not page.article_text):
            problems.append(f"{shown}: empty page (no title or no content)")
        for href in page.links:
            found = _target(site, path, href)
            if found is None:
                continue
            target, anchor = found
            if not os.path.exists(target):
                problems.append(f"{shown}: link {href!r} -> missing page")
            elif anchor and target in pages and anchor not in pages[target].ids:
                problems.append(f"{shown}: link {href!r} -> missing anchor")
    return problems


def main(argv):
    """Checks the site named on the command line; returns the exit code."""
    site = argv[1] if len(argv) > 1 else "site"
    problems = check(site)
    for problem in problems:
        print(problem)
    print(f"check_site: {len(problems)} problem(s) in {site}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
