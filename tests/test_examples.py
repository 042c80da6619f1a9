"""Runs the examples with small flags and checks what they print."""

import csv
import math
import os
import re
import subprocess
import sys
import tempfile

import matplotlib
from tensorboard.backend.event_processing import event_accumulator

from tests import testing

matplotlib.use("Agg")
from matplotlib import pyplot  # noqa: E402

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


def printed(output, label):
    """Returns the number printed after `label: ` in `output`."""
    match = re.search(rf"(?m)^{re.escape(label)}: (-?[0-9.e+-]+)", output)
    if match is None:
        raise AssertionError(f"{label!r} not printed:\n{output}")
    return float(match.group(1))


def validation_accuracy(output):
    return printed(output, "validation accuracy")


class ExamplesTest(testing.TestCase):
    def test_quickstart_learns_digits(self):
        """The quickstart prints a validation accuracy well above chance."""
        output = run_example("quickstart", "--epochs=5")
        self.assertGreater(validation_accuracy(output), 0.6)

    def test_activity_regularization_logs_each_component(self):
        """Every loss component and its val_ twin is printed, the components
        add up to the loss, and the model learns."""
        output = run_example("activity_regularization", "--epochs=3")
        components = ("data_loss", "regularization_loss", "l2_penalty")
        for name in (*components, "logit_penalty"):
            self.assertRegex(output, f"(?m)^{name}: [0-9.]+$")
            self.assertRegex(output, f"(?m)^val_{name}: [0-9.]+$")
        total = sum(
            printed(output, name) for name in (*components, "logit_penalty")
        )
        self.assertAllClose(total, printed(output, "loss"), rtol=1e-3)
        self.assertGreater(validation_accuracy(output), 0.5)

    def test_mnist_mlp_writes_logs_png_and_csv(self):
        """TensorBoard events, a PNG and a CSV with one column per layer,
        and an accuracy above chance after one epoch on digits."""
        output_dir = tempfile.mkdtemp()
        output = run_example(
            "mnist_mlp", "--epochs=2", f"--output_dir={output_dir}"
        )
        self.assertGreater(validation_accuracy(output), 0.3)
        with open(os.path.join(output_dir, "gradient_norms.png"), "rb") as f:
            self.assertEqual(f.read(4), b"\x89PNG")
        with open(os.path.join(output_dir, "gradient_norms.csv")) as f:
            header = f.readline().strip()
        self.assertEqual(header, "step,dense_1,dense_2,predictions")
        events = os.listdir(os.path.join(output_dir, "logs", "train"))
        self.assertTrue(any(name.startswith("events.out") for name in events))

    def test_inspect_gradients_writes_what_it_inspected(self):
        """TensorBoard tags per layer (read back with TensorBoard's own
        reader), a PNG that decodes, a CSV of finite positive norms, every
        statistic printed, and an accuracy above chance."""
        output_dir = tempfile.mkdtemp()
        output = run_example(
            "inspect_gradients", "--epochs=2", f"--output_dir={output_dir}"
        )
        self.assertGreater(validation_accuracy(output), 0.3)
        for statistic in ("norm", "max_abs", "zero_fraction", "update_ratio"):
            self.assertRegex(output, rf"(?m)^  {statistic}: dense_1=")
        layers = ["dense_1", "dense_2", "predictions"]
        image = pyplot.imread(os.path.join(output_dir, "gradient_norms.png"))
        self.assertGreater(min(image.shape[:2]), 100)
        with open(os.path.join(output_dir, "gradient_norms.csv")) as f:
            rows = list(csv.DictReader(f))
        self.assertEqual(list(rows[0]), ["step", *layers])
        norms = [float(row[layer]) for row in rows for layer in layers]
        self.assertTrue(all(0 < n < math.inf for n in norms))
        accumulator = event_accumulator.EventAccumulator(
            os.path.join(output_dir, "logs", "train"),
            size_guidance={event_accumulator.TENSORS: 0},
        )
        accumulator.Reload()
        tags = set(accumulator.Tags()["tensors"])
        for layer in layers:
            self.assertIn(f"gradient_norm/{layer}", tags)
            self.assertIn(f"gradients/{layer}", tags)
        self.assertIn("epoch_loss", tags)  # Keras' TensorBoard, same dir

    def test_linear_regression_recovers_the_coefficients(self):
        """The fitted W and b are within 0.02 of the generating ones."""
        output = run_example("linear_regression", "--epochs=10")
        self.assertLess(printed(output, "max coefficient error"), 0.02)

    def test_gradient_centralization_centres_every_update(self):
        """With centralization the weight change of each unit sums to ~0
        over its inputs (the definition); without, it does not. Both
        variants learn."""
        output = run_example("gradient_centralization", "--epochs=2")
        self.assertGreater(
            printed(output, "centralized validation accuracy"), 0.5
        )
        self.assertGreater(printed(output, "plain validation accuracy"), 0.5)
        self.assertLess(
            printed(
                output, "centralized largest per-unit sum of weight changes"
            ),
            1e-4,
        )
        self.assertGreater(
            printed(output, "plain largest per-unit sum of weight changes"),
            1e-2,
        )

    def test_wgan_gp_logs_the_library_penalty_and_writes_a_png(self):
        """The critic's gradient penalty (from the library) and both losses
        are logged, finite, and the grid is a real PNG."""
        output_png = os.path.join(tempfile.mkdtemp(), "grid.png")
        output = run_example(
            "wgan_gp",
            "--epochs=2",
            "--critic_steps=2",
            f"--output={output_png}",
        )
        for name in (
            "d_loss",
            "g_loss",
            "critic_input_gradient_penalty",
            "critic_grad_norm",
            "generator_grad_norm",
        ):
            self.assertTrue(math.isfinite(printed(output, name)), name)
        self.assertGreater(printed(output, "critic_input_gradient_penalty"), 0)
        with open(output_png, "rb") as f:
            self.assertEqual(f.read(4), b"\x89PNG")

    def test_gan_logs_both_networks_and_writes_a_png(self):
        """Both losses and each network's gradient norms are logged, the
        discriminator's clipped norm respects its bound, and the grid of
        generated digits is a real PNG."""
        output_png = os.path.join(tempfile.mkdtemp(), "grid.png")
        output = run_example(
            "gan",
            "--epochs=2",
            "--discriminator_clipnorm=0.5",
            f"--output={output_png}",
        )
        for name in ("d_loss", "g_loss", "generator_grad_norm"):
            self.assertTrue(math.isfinite(printed(output, name)), name)
        self.assertGreater(printed(output, "discriminator_grad_norm"), 0.0)
        self.assertLessEqual(
            printed(output, "discriminator_grad_norm_clipped"), 0.5 + 1e-4
        )
        self.assertIn("generator gradient norms by layer: g_dense_1=", output)
        with open(output_png, "rb") as handle:
            self.assertEqual(handle.read(8), b"\x89PNG\r\n\x1a\n")

    def test_mnist_without_network_fails_with_a_clear_message(self):
        """--dataset=mnist either trains (network there) or exits with a
        message naming --dataset=digits; never a bare traceback."""
        home = tempfile.mkdtemp()  # no cached copy of MNIST
        result = subprocess.run(
            [
                sys.executable,
                os.path.join(_ROOT, "examples", "mnist_mlp.py"),
                "--dataset=mnist",
                "--epochs=1",
                f"--output_dir={home}",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "KERAS_HOME": home},
            check=False,
        )
        if result.returncode == 0:
            self.assertGreater(validation_accuracy(result.stdout), 0.5)
            return
        self.assertEqual(result.returncode, 1, result.stderr[-2000:])
        self.assertIn("--dataset=digits", result.stderr)
        self.assertNotIn("Traceback", result.stderr)
