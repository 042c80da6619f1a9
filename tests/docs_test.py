"""Every Python block of the README and the guides runs as pasted, on its own.

Each ```python block of README.md and of docs/**/*.md is a test of its
own: it runs as a script in a fresh interpreter's state (forked from one
that has only imported Keras and custom_fit: `tests/prewarmed.py`), in an
empty temporary directory (files
it writes, such as TensorBoard logs, land there), and must exit 0. A block
added to a page is tested without any change here. A block that is not
meant to run (an outline of the step) is preceded by a line starting with
`SKIP_MARKER`. What some blocks print is checked too (`EXPECTED`), from the
same run.
"""

import functools
import os
import re
import sys
import tempfile

from absl.testing import parameterized

from tests import prewarmed
from tests import testing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(_ROOT, "README.md")
DOCS = os.path.join(_ROOT, "docs")

# An HTML comment (invisible on a rendered page) on the line before a block.
SKIP_MARKER = "<!-- readme-test: skip"

_FENCE = re.compile(r"^```(\S*)\s*$")

# What a block prints, by (page, heading): a regular expression that its
# output must match (the figures the page's prose states).
EXPECTED = {
    ("README.md", "Quickstart"): r"validation accuracy: (0\.[5-9]|1\.0)",
    (
        "docs/guides/optimizers.md",
        "Fine-tuning a pretrained custom_fit model",
    ): r"\['loss', 'val_loss'\]",
    ("docs/guides/skipping.md", "Spikes"): r"\[1\.0\]",
    ("docs/guides/inspection.md", "A model you already have"): (
        r"\['base/hidden', 'base/logits'\]\s+\['hidden', 'logits'\]\s+"
        r"(\['base/hidden', 'base/logits'\]\s+){2}$"
    ),
    (
        "docs/guides/several-networks.md",
        "A teacher and a student: what the loss computed, handed back",
    ): r"\['distillation_loss', 'sparse_categorical_accuracy'\]",
    ("docs/guides/accumulation.md", "Gradient accumulation"): r"updates: 1",
    (
        "docs/guides/inspection.md",
        "Your own figures, and your own `loss`",
    ): r"\['abs_error', 'loss', 'val_abs_error', 'val_loss'\]",
    ("docs/guides/pitfalls.md", "Refused, with the fix in the message"): (
        r"(?s)Put the custom_fit mixins first.*GradientInspectionMixin.*"
        r"Did you mean `global_clipnorm`.*fixed when the model is built"
    ),
    ("docs/guides/your-own-mixin.md", "State"): r"^[0-9.]+\s*$",
    ("docs/guides/your-own-mixin.md", "State per variable"): r"^True\s*$",
    ("docs/guides/your-own-mixin.md", "The names your mixin logs"): (
        r"\['update_norm/hidden', 'update_norm/out'\]"
    ),
    (
        "docs/guides/privacy.md",
        "Auditing any scores: a lower bound on epsilon",
    ): r"epsilon >= 1\.75 \(true epsilon 2\.0\)",
    ("docs/guides/privacy.md", "Auditing your own run"): (
        r"(?s)Canary audit of 87 updates, \d+ canaries in.*"
        r"(: passed\s+.*){5}$"
    ),
    ("docs/guides/your-own-mixin.md", "Annealed gradient noise"): (
        r"(?s)Received: gradient_noise_stddev=-0\.1.*Did you mean "
        r"`gradient_noise_stddev`.*ExponentialDecay 1.*fixed when the model"
    ),
}


class Block:
    """A fenced Python block of a page and where it stands."""

    def __init__(self, page, code, line, heading, skipped):
        self.page = page  # relative to the repository, "docs/guides/x.md"
        self.code = code
        self.line = line  # of the opening fence, 1-based
        self.heading = heading
        self.skipped = skipped

    @property
    def first_line(self):
        return next((s for s in self.code.splitlines() if s.strip()), "")

    def describe(self):
        return (
            f"{self.page} block at line {self.line} (under "
            f"{self.heading!r}), first line {self.first_line!r}"
        )


def python_blocks(text, page="README.md"):
    """Returns the ```python blocks of Markdown `text`, in order."""
    blocks = []
    heading = "(top)"
    previous = ""  # the last non-blank line outside a block
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        fence = _FENCE.match(line)
        if fence is None:
            if line.startswith("#"):
                heading = line.lstrip("#").strip()
            if line.strip():
                previous = line.strip()
            index += 1
            continue
        end = index + 1
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page}: unclosed fence at {index + 1}")
        if fence.group(1) == "python":
            blocks.append(
                Block(
                    page,
                    "\n".join(lines[index + 1 : end]) + "\n",
                    index + 1,
                    heading,
                    previous.startswith(SKIP_MARKER),
                )
            )
        previous = "```"
        index = end + 1
    return blocks


def pages():
    """The pages whose blocks run: the README, then every docs page."""
    found = [README]
    for directory, _, files in sorted(os.walk(DOCS)):
        found.extend(
            os.path.join(directory, f)
            for f in sorted(files)
            if f.endswith(".md")
        )
    return found


def all_blocks():
    blocks = []
    for path in pages():
        with open(path, encoding="utf-8") as handle:
            blocks.extend(
                python_blocks(handle.read(), os.path.relpath(path, _ROOT))
            )
    return blocks


@functools.cache
def run_block(code):
    """Runs `code` as a script of its own, in an empty temporary directory
    (`prewarmed.run_code`: a fresh interpreter's run); returns the
    result."""
    with tempfile.TemporaryDirectory() as directory:
        return prewarmed.run_code(code, directory, timeout=600)


def _named_blocks():
    """The blocks to run, each code once (the site's home page repeats the
    README's quickstart)."""
    named = []
    seen = set()
    for block in all_blocks():
        if block.skipped or block.code in seen:
            continue
        seen.add(block.code)
        page = os.path.splitext(os.path.basename(block.page))[0]
        named.append((f"{page.replace('-', '_')}_line_{block.line}", block))
    return named


class DocsBlockTest(testing.TestCase):
    @parameterized.named_parameters(_named_blocks())
    def test_block_runs(self, block):
        """The block, pasted into a fresh interpreter, exits 0 (and prints
        what its page says, where `EXPECTED` has it)."""
        result = run_block(block.code)
        self.assertEqual(
            result.returncode,
            0,
            f"{block.describe()} failed:\n{result.stderr[-3000:]}",
        )
        expected = EXPECTED.get((block.page, block.heading))
        if expected is not None:
            self.assertRegex(result.stdout, expected, block.describe())


class DocsPagesTest(testing.TestCase):
    def test_expected_outputs_name_real_blocks(self):
        """Each entry of EXPECTED is a block of its page: a renamed heading
        would otherwise leave its output unchecked."""
        found = {(b.page, b.heading) for b in all_blocks() if not b.skipped}
        self.assertEmpty(set(EXPECTED) - found)

    def test_every_python_block_is_found(self):
        """Each ```python fence is a block; skip markers are rare and used.

        Guards the parser: a block it missed would go untested silently.
        """
        for path in pages():
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
            blocks = python_blocks(text, path)
            self.assertLen(
                blocks, len(re.findall(r"^```python$", text, re.M)), path
            )
            skipped = [block for block in blocks if block.skipped]
            self.assertLen(skipped, text.count(SKIP_MARKER), path)
            self.assertLessEqual(len(skipped), 1, path)

    def test_every_guide_is_in_the_site(self):
        """Each page of docs/guides is in the site's navigation."""
        with open(os.path.join(_ROOT, "mkdocs.yml"), encoding="utf-8") as f:
            config = f.read()
        for name in os.listdir(os.path.join(DOCS, "guides")):
            self.assertIn(f"guides/{name}", config)

    def test_tables_are_whole(self):
        """Every row of every Markdown table has its header's cells: a row
        that runs into the next one hides it on a rendered page."""
        for path in pages():
            with open(path, encoding="utf-8") as handle:
                lines = handle.read().splitlines()
            in_fence = False
            width = None
            for number, line in enumerate(lines, 1):
                if line.startswith("```"):
                    in_fence = not in_fence
                if in_fence or not line.startswith("|"):
                    width = None
                    continue
                cells = (
                    len(re.findall(r"(?<!\\)\|", line.replace("``", ""))) - 1
                )
                if width is None:
                    width = cells
                self.assertEqual(cells, width, f"{path}:{number}: {line}")

    def test_readme_links_land(self):
        """Every relative link of the README names a file of the
        repository (the guides, the changelog)."""
        with open(README, encoding="utf-8") as handle:
            text = handle.read()
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            self.assertTrue(os.path.exists(os.path.join(_ROOT, target)), target)

    def test_parser_honours_the_skip_marker(self):
        text = (
            "# Title\n\n```python\nprint(1)\n```\n\n"
            f"{SKIP_MARKER} (outline) -->\n```python\nreturn x\n```\n"
            "```bash\nls\n```\n## Next\n```python\nprint(2)\n```\n"
        )
        blocks = python_blocks(text)
        self.assertEqual(
            [(b.line, b.heading, b.skipped, b.first_line) for b in blocks],
            [
                (3, "Title", False, "print(1)"),
                (8, "Title", True, "return x"),
                (15, "Next", False, "print(2)"),
            ],
        )


class SiteCheckTest(testing.TestCase):
    def test_finds_broken_links_anchors_and_empty_pages(self):
        """docs/check_site.py reports a missing page, a missing anchor and
        an empty page, and accepts the links that land."""
        sys.path.insert(0, DOCS)
        try:
            import check_site
        finally:
            sys.path.remove(DOCS)
        site = tempfile.mkdtemp()
        os.makedirs(os.path.join(site, "guide"))
        page = (
            "<html><head><title>{}</title></head><body><article>{}"
            "</article></body></html>"
        )
        with open(os.path.join(site, "index.html"), "w") as handle:
            handle.write(
                page.format(
                    "Home",
                    '<h2 id="top">Top</h2><a href="guide/#usage">ok</a>'
                    '<a href="guide/#nowhere">anchor</a>'
                    '<a href="missing/">page</a>'
                    '<a href="https://keras.io">away</a>',
                )
            )
        with open(os.path.join(site, "guide", "index.html"), "w") as handle:
            handle.write(page.format("Guide", '<h2 id="usage">Usage</h2>'))
        os.makedirs(os.path.join(site, "empty"))
        with open(os.path.join(site, "empty", "index.html"), "w") as handle:
            handle.write(page.format("Empty", ""))
        self.assertEqual(
            check_site.check(site),
            [
                "empty/index.html: empty page (no title or no content)",
                "index.html: link 'guide/#nowhere' -> missing anchor",
                "index.html: link 'missing/' -> missing page",
            ],
        )
