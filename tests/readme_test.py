"""Every Python block of the README runs as pasted, on its own.

Each ```python block of README.md is a test of its own: it runs in a fresh
interpreter, in an empty temporary directory (files it writes, such as
TensorBoard logs, land there), and must exit 0. A block added to the README
is tested without any change here. A block that is not meant to run (an
outline of the step) is preceded by a line starting with `SKIP_MARKER`.
"""

import functools
import os
import re
import subprocess
import sys
import tempfile

from absl.testing import parameterized

from tests import testing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(_ROOT, "README.md")

# An HTML comment (invisible on a rendered page) on the line before a block.
SKIP_MARKER = "<!-- readme-test: skip"

_FENCE = re.compile(r"^```(\S*)\s*$")


class Block:
    """A fenced Python block of the README and where it stands."""

    def __init__(self, code, line, heading, skipped):
        self.code = code
        self.line = line  # of the opening fence, 1-based
        self.heading = heading
        self.skipped = skipped

    @property
    def first_line(self):
        return next((s for s in self.code.splitlines() if s.strip()), "")

    def describe(self):
        return (
            f"README.md block at line {self.line} (under {self.heading!r}), "
            f"first line {self.first_line!r}"
        )


def python_blocks(text):
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
            raise AssertionError(f"README.md: unclosed fence at {index + 1}")
        if fence.group(1) == "python":
            blocks.append(
                Block(
                    "\n".join(lines[index + 1 : end]) + "\n",
                    index + 1,
                    heading,
                    previous.startswith(SKIP_MARKER),
                )
            )
        previous = "```"
        index = end + 1
    return blocks


def readme_blocks():
    with open(README, encoding="utf-8") as handle:
        return python_blocks(handle.read())


@functools.cache
def run_block(code):
    """Runs `code` as a script in a fresh interpreter; returns the result."""
    with tempfile.TemporaryDirectory() as directory:
        script = os.path.join(directory, "readme_block.py")
        with open(script, "w", encoding="utf-8") as handle:
            handle.write(code)
        return subprocess.run(
            [sys.executable, script],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
            check=False,
        )


def _named_blocks():
    return [
        (f"line_{block.line}", block)
        for block in readme_blocks()
        if not block.skipped
    ]


class ReadmeTest(testing.TestCase):
    @parameterized.named_parameters(_named_blocks())
    def test_block_runs(self, block):
        """The block, pasted into a fresh interpreter, exits 0."""
        result = run_block(block.code)
        self.assertEqual(
            result.returncode,
            0,
            f"{block.describe()} failed:\n{result.stderr[-3000:]}",
        )

    def test_quickstart_learns(self):
        """The quickstart block ends above chance (10 classes)."""
        quickstart = [b for b in readme_blocks() if b.heading == "Quickstart"]
        self.assertTrue(quickstart, "README.md has no Quickstart block")
        result = run_block(quickstart[0].code)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        match = re.search(r"validation accuracy: ([0-9.]+)", result.stdout)
        self.assertIsNotNone(match, result.stdout[-3000:])
        self.assertGreater(float(match.group(1)), 0.5)

    def test_fine_tuning_block_logs_the_outer_loss(self):
        """The fine-tuning block's model logs `loss` and `val_loss`."""
        blocks = [
            b
            for b in readme_blocks()
            if b.heading == "Fine-tuning a pretrained custom_fit model"
        ]
        self.assertLen(blocks, 1)
        result = run_block(blocks[0].code)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn("['loss', 'val_loss']", result.stdout)

    def test_spike_block_skips_the_corrupted_batch(self):
        """The spike-skipping block skips exactly its corrupted batch."""
        blocks = [
            b
            for b in readme_blocks()
            if b.heading == "Skipping gradient spikes"
        ]
        self.assertLen(blocks, 1)
        result = run_block(blocks[0].code)
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        self.assertIn("[1.0]", result.stdout)

    def test_every_python_block_is_found(self):
        """Each ```python fence is a block; skip markers are rare and used.

        Guards the parser: a block it missed would go untested silently.
        """
        with open(README, encoding="utf-8") as handle:
            text = handle.read()
        blocks = python_blocks(text)
        self.assertLen(blocks, len(re.findall(r"^```python$", text, re.M)))
        skipped = [block for block in blocks if block.skipped]
        self.assertLen(skipped, text.count(SKIP_MARKER))
        self.assertLessEqual(len(skipped), 2, [b.describe() for b in skipped])

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
