"""Every mixin under `keras.distribution.ModelParallel`, on 8 host devices.

The checks run in a process of their own (`tests/scripts/model_parallel.py`:
JAX reads the device count at start-up), once per way of setting the
distribution, and each configuration's figures are asserted here: weights
equal one device, every weight-shaped custom_fit variable keeps its
weight's sharding, the train step compiles once, custom_fit's state costs
no more per device than the weights' shards, and the compiled step holds
no buffer of a whole sharded kernel.
"""

import functools
import json
import os
import subprocess
import sys

import pytest
from absl.testing import parameterized

from tests import testing

_SCRIPT = os.path.join(
    os.path.dirname(__file__), "scripts", "model_parallel.py"
)
_ALL = (
    "train_step",
    "clipping",
    "inspection",
    "accumulation",
    "skip_nonfinite",
    "regularization",
    "sharpness",
    "pcgrad",
    "privacy",
    "privacy_noise",
    "privacy_microbatches",
)
# Under `distribution.scope()` only, the configurations with state.
_SCOPE = ("train_step", "inspection", "accumulation", "pcgrad", "privacy")


@functools.cache
def results(distribution, configurations):
    """Runs the script once; returns its figures by configuration."""
    env = dict(os.environ, KERAS_BACKEND="jax", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("XLA_FLAGS", None)
    completed = subprocess.run(
        [
            sys.executable,
            _SCRIPT,
            f"--distribution={distribution}",
            f"--configurations={','.join(configurations)}",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        env=env,
        check=False,
    )
    if completed.returncode:
        raise AssertionError(completed.stderr[-4000:])
    lines = [
        json.loads(line)
        for line in completed.stdout.splitlines()
        if line.startswith("{")
    ]
    return {line["name"]: line for line in lines}


@pytest.mark.jax
class ModelParallelTest(testing.TestCase):
    @parameterized.named_parameters(
        [(f"set_distribution_{name}", "set", name, _ALL) for name in _ALL]
        + [(f"scope_{name}", "scope", name, _SCOPE) for name in _SCOPE]
    )
    def test_mixin_under_model_parallel(self, distribution, name, run):
        """On a 2x4 mesh with kernels laid out (None, "model"): weights
        equal one device (1e-6; DP noise aside); weight-shaped custom_fit
        state has its weight's sharding and costs at most 1.1x the weight
        shards per device; the step compiles once, holds no whole kernel
        and no collective larger than the step without options (and DP
        noise no array larger than the step without noise)."""
        figures = results(distribution, run)[name]
        self.assertIn("P(None, 'model')", figures["weight_shardings"])
        if name != "privacy_noise":  # its noise is drawn otherwise
            self.assertLessEqual(figures["weights"], 1e-6)
        self.assertEqual(figures["layouts"], [])
        self.assertEqual(figures["compiles"], 1)
        for kind, ratio in figures["state_ratio"].items():
            self.assertLessEqual(ratio, 1.1, kind)
        self.assertEqual(figures["full_kernels"], [])
        # No collective larger than those of the step without options
        # (Keras' own: activations and the batch's gradient sums).
        baseline = results(distribution, run)["train_step"]
        self.assertLessEqual(
            figures["largest_collective"], baseline["largest_collective"]
        )
        if name == "privacy_noise":
            # The noise, drawn in each weight's layout, makes no array
            # larger than the step without noise (a draw split over the
            # weights would hold the whole draw on each device).
            quiet = results(distribution, run)["privacy"]
            self.assertLessEqual(
                figures["largest_array"], quiet["largest_array"]
            )
