"""Runs the examples with small flags and checks what they print."""

import os
import re
import subprocess
import sys

from tests import testing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name, *flags):
    """Runs `examples/<name>.py` in a fresh process; returns its stdout."""
    result = subprocess.run(
        [sys.executable, os.path.join(_ROOT, "examples", f"{name}.py"), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode != 0:
        raise AssertionError(f"{name} failed:\n{result.stderr[-3000:]}")
    return result.stdout


class ExamplesTest(testing.TestCase):
    def test_quickstart_learns_digits(self):
        """The quickstart prints a validation accuracy well above chance."""
        output = run_example("quickstart", "--epochs=5")
        match = re.search(r"validation accuracy: ([0-9.]+)", output)
        self.assertIsNotNone(match, output)
        self.assertGreater(float(match.group(1)), 0.6)
