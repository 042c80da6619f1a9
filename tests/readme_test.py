"""The README's quickstart runs as written and learns."""

import os
import re
import subprocess
import sys

from tests import testing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def quickstart_code():
    """Returns the first Python block under the README's Quickstart."""
    with open(os.path.join(_ROOT, "README.md")) as handle:
        readme = handle.read()
    match = re.search(r"## Quickstart\n\n```python\n(.*?)```", readme, re.S)
    if match is None:
        raise AssertionError("README.md has no Quickstart code block")
    return match.group(1)


class ReadmeTest(testing.TestCase):
    def test_quickstart_runs_and_learns(self):
        """The quickstart block, run verbatim, ends above chance."""
        code = quickstart_code() + (
            "\nprint('val_accuracy', model.history.history['val_accuracy'][-1])"
        )
        result = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
            check=False,
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        accuracy = float(result.stdout.split("val_accuracy")[-1])
        self.assertGreater(accuracy, 0.5)
