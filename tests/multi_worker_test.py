"""MultiWorkerMirroredStrategy: two worker processes on 127.0.0.1."""

import os
import tempfile

import numpy as np
import pytest

from tests import testing

_EXAMPLE = os.path.join(testing.EXAMPLES_DIR, "multi_worker.py")
_TIMEOUT = 420  # seconds for the whole run, workers included


@pytest.mark.tensorflow
class MultiWorkerTest(testing.TestCase):
    def test_two_workers_equal_single_process(self):
        """Both workers end with identical weights, equal (atol 1e-6) to a
        single process with the same global batch; clipping and inspection
        are on."""
        output_dir = tempfile.mkdtemp()
        common = ["--epochs=2", f"--output_dir={output_dir}", "--timeout=360"]
        output = testing.run_bounded(
            _EXAMPLE, "--workers=2", *common, timeout=_TIMEOUT
        )
        self.assertIn("validation accuracy", output)
        testing.run_bounded(_EXAMPLE, "--workers=1", *common, timeout=_TIMEOUT)
        workers = [
            np.load(os.path.join(output_dir, f"worker_{i}.npz")) for i in (0, 1)
        ]
        single = np.load(os.path.join(output_dir, "single.npz"))
        for key in single.files:
            self.assertAllClose(
                workers[0][key], workers[1][key], atol=0, rtol=0
            )
            self.assertAllClose(workers[0][key], single[key], atol=1e-6, rtol=0)
