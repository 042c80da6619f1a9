"""Runs the examples of MultiOptimizer, PCGrad and scheduled options with
small flags, under the current KERAS_BACKEND, and checks what they print."""

import math
import os
import re

import pytest
from sklearn import datasets

from tests import prewarmed
from tests import testing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(name, *flags):
    """Runs `examples/<name>.py` as a program of its own (`prewarmed.run`)
    under the backend of this session; returns its stdout."""
    result = prewarmed.run(
        [os.path.join(_ROOT, "examples", f"{name}.py"), *flags], timeout=300
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


def digits_train_size(validation_fraction=0.2):
    """The number of training images of examples/digits.py's split
    (scikit-learn rounds the held-out share up)."""
    total = len(datasets.load_digits().target)
    return total - math.ceil(validation_fraction * total)


@pytest.mark.slow
class FineTuningExampleTest(testing.TestCase):
    def test_each_group_trains_at_its_own_rate(self):
        """Each group trains at its own rate; the model learns."""
        epochs, batch_size = 5, 32
        output = run_example(
            "fine_tuning",
            "--pretrain_epochs=5",
            f"--epochs={epochs}",
            f"--batch_size={batch_size}",
        )
        self.assertAllClose(printed(output, "backbone learning rate"), 1e-5)
        self.assertAllClose(printed(output, "head learning rate"), 1e-3)
        updates = epochs * math.ceil(digits_train_size() / batch_size)
        self.assertEqual(printed(output, "backbone updates"), updates)
        self.assertEqual(printed(output, "head updates"), updates)
        backbone = printed(output, "backbone relative weight change")
        head = printed(output, "head relative weight change")
        self.assertGreater(backbone, 0.0)
        self.assertLess(backbone, 0.05 * head)
        self.assertGreater(
            printed(output, "pretraining validation accuracy (digits 0-4)"),
            0.8,
        )
        self.assertGreater(printed(output, "validation accuracy"), 0.4)


@pytest.mark.slow
class MultiTaskPCGradExampleTest(testing.TestCase):
    def test_both_methods_learn_every_head(self):
        """PCGrad and the sum learn every head above chance."""
        output = run_example("multi_task_pcgrad", "--epochs=3")
        chance = {"digit": 0.1, "parity": 0.5, "large": 0.5}
        for method in ("pcgrad", "sum"):
            for head, floor in chance.items():
                accuracy = printed(
                    output, f"{method} {head} validation accuracy"
                )
                self.assertGreater(accuracy, floor + 0.2, (method, head))
            pairs = printed(output, f"{method} conflicting task pairs per step")
            self.assertBetween(pairs, 0.0, 3.0)
        match = re.search(
            r"(?m)^pcgrad task order at the last step: \[(.*)\]$", output
        )
        self.assertIsNotNone(match, output)
        order = sorted(int(i) for i in match.group(1).split(","))
        self.assertEqual(order, [0, 1, 2])


@pytest.mark.slow
class ScheduledOptionsExampleTest(testing.TestCase):
    def test_logged_values_follow_the_schedules(self):
        """The printed values follow the schedules' formulas."""
        epochs, batch_size, warmup, decay = 4, 64, 2, 3
        output = run_example(
            "scheduled_options",
            f"--epochs={epochs}",
            f"--batch_size={batch_size}",
            f"--warmup_epochs={warmup}",
            f"--l2_decay_epochs={decay}",
            "--l2_start=1e-3",
            "--l2_end=1e-5",
            "--clipnorm_start=0.05",
            "--clipnorm_end=1.0",
        )
        steps = math.ceil(digits_train_size() / batch_size)
        self.assertEqual(printed(output, "steps per epoch"), steps)

        def l2_weight(step):
            fraction = min(step, decay * steps) / (decay * steps)
            return (1e-3 - 1e-5) * (1.0 - fraction) + 1e-5

        def clipnorm(step):
            return 0.05 + (1.0 - 0.05) * min(step / (warmup * steps), 1.0)

        lines = re.findall(r"(?m)^epoch (\d+): (.*)$", output)
        self.assertEqual([int(e) for e, _ in lines], [1, 2, 3, 4])
        for epoch, fields in lines:
            logged = {
                key: float(value)
                for key, value in re.findall(r"(\S+)=(\S+)", fields)
            }
            last_step = int(epoch) * steps - 1
            self.assertAllClose(
                logged["l2_weight"], l2_weight(last_step), rtol=1e-4
            )
            self.assertAllClose(
                logged["global_clipnorm"], clipnorm(last_step), rtol=1e-4
            )
            self.assertLessEqual(
                logged["grad_norm_clipped"], logged["global_clipnorm"] + 1e-3
            )
            self.assertLessEqual(
                logged["grad_norm_clipped"], logged["grad_norm"] + 1e-3
            )
            self.assertBetween(logged["clip_rate"], 0.0, 1.0)
        self.assertGreater(printed(output, "validation accuracy"), 0.5)
