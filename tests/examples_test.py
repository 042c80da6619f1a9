"""Runs the examples with small flags and checks what they print."""

import os
import re
import subprocess
import sys
import tempfile

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

    def test_activity_regularization_logs_each_component(self):
        """Every loss component and its val_ twin is printed."""
        output = run_example("activity_regularization", "--epochs=1")
        for name in (
            "data_loss",
            "regularization_loss",
            "l2_penalty",
            "logit_penalty",
            "val_data_loss",
            "val_logit_penalty",
        ):
            self.assertRegex(output, f"(?m)^{name}: [0-9.]+$")

    def test_inspect_gradients_writes_logs_png_and_csv(self):
        """TensorBoard events, a PNG and a CSV with one column per layer."""
        output_dir = tempfile.mkdtemp()
        run_example(
            "inspect_gradients", "--epochs=1", f"--output_dir={output_dir}"
        )
        with open(os.path.join(output_dir, "gradient_norms.png"), "rb") as f:
            self.assertEqual(f.read(4), b"\x89PNG")
        with open(os.path.join(output_dir, "gradient_norms.csv")) as f:
            header = f.readline().strip()
        self.assertEqual(header, "step,dense_1,dense_2,predictions")
        events = os.listdir(os.path.join(output_dir, "logs", "train"))
        self.assertTrue(any(name.startswith("events.out") for name in events))
