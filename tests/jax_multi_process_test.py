"""JAX over two processes on 127.0.0.1: keras.distribution, CPU gloo."""

import os
import tempfile

import numpy as np
import pytest

from tests import testing

_EXAMPLE = os.path.join(testing.EXAMPLES_DIR, "jax_multi_process.py")
_TIMEOUT = 420  # seconds for the whole run, processes included


@pytest.mark.jax
class JaxMultiProcessTest(testing.TestCase):
    def test_two_processes_equal_single_process(self):
        """Both processes end with identical weights and per-layer norms,
        equal (atol 1e-6) to one process with the same global batch, with
        clipping and inspection on; their validation accuracy is the same."""
        output_dir = tempfile.mkdtemp()
        common = ["--epochs=2", f"--output_dir={output_dir}", "--timeout=360"]
        env = dict(os.environ, KERAS_BACKEND="jax")
        env.pop("XLA_FLAGS", None)  # one device per process
        outputs = [
            testing.run_bounded(
                _EXAMPLE,
                f"--processes={count}",
                *common,
                timeout=_TIMEOUT,
                env=env,
            )
            for count in (2, 1)
        ]
        accuracies = [
            line
            for out in outputs
            for line in out.splitlines()
            if line.startswith("validation accuracy")
        ]
        self.assertLen(accuracies, 2)
        self.assertEqual(accuracies[0], accuracies[1])
        processes = [
            np.load(os.path.join(output_dir, f"process_{i}.npz"))
            for i in (0, 1)
        ]
        single = np.load(os.path.join(output_dir, "single.npz"))
        for key in single.files:
            self.assertAllClose(
                processes[0][key], processes[1][key], atol=0, rtol=0
            )
            self.assertAllClose(
                processes[0][key], single[key], atol=1e-6, rtol=0
            )
