"""MultiWorkerMirroredStrategy: two worker processes on 127.0.0.1."""

import os
import tempfile

import numpy as np
import pytest

from tests import testing

_EXAMPLE = os.path.join(testing.EXAMPLES_DIR, "multi_worker.py")
_WORKERS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "scripts", "tf_workers.py"
)
_TIMEOUT = 420  # seconds for the whole run, workers included


@pytest.mark.tensorflow
class MultiWorkerTest(testing.TestCase):
    def test_two_workers_equal_single_process(self):
        """Both workers end with identical weights, equal (atol 1e-6) to a
        single process with the same global batch; clipping and inspection
        are on."""
        output_dir = tempfile.mkdtemp()
        common = ["--epochs=2", f"--output_dir={output_dir}", "--timeout=360"]
        output, _ = testing.run_bounded_together(
            (_EXAMPLE, "--workers=2", *common, {"timeout": _TIMEOUT}),
            (_EXAMPLE, "--workers=1", *common, {"timeout": _TIMEOUT}),
        )
        self.assertIn("validation accuracy", output)
        workers = [
            np.load(os.path.join(output_dir, f"worker_{i}.npz")) for i in (0, 1)
        ]
        single = np.load(os.path.join(output_dir, "single.npz"))
        for key in single.files:
            self.assertAllClose(
                workers[0][key], workers[1][key], atol=0, rtol=0
            )
            self.assertAllClose(workers[0][key], single[key], atol=1e-6, rtol=0)

    def test_files_written_once_and_sampler_refused(self):
        """Over two workers: Keras' writing callbacks, `GradientTensorBoard`,
        `GradientNormHistory.to_csv` and `BackupAndRestore`, given to both,
        write from the chief what one process writes and nothing from the
        other (both run them: saving reads synchronized variables, an
        all-reduce), a run resumed from the backup ends where one process
        ends; and a `PoissonSampler` fed to a model made in the strategy's
        scope is refused even with `fit` called outside it."""
        from tests.scripts import files_once

        output_dir = tempfile.mkdtemp()
        testing.run_bounded_together(
            *(
                (
                    _WORKERS,
                    f"--workers={count}",
                    f"--output_dir={output_dir}",
                    "--timeout=360",
                    {"timeout": _TIMEOUT},
                )
                for count in (2, 1)
            )
        )
        saved = {
            label: dict(np.load(os.path.join(output_dir, f"{label}.npz")))
            for label in ("process_0", "process_1", "single")
        }
        for label in ("process_0", "process_1"):
            self.assertEqual(float(saved[label].pop("refused_sampler")), 1)
        self.assertEqual(float(saved["single"].pop("refused_sampler")), 0)
        testing.check_files_written_once(
            self, output_dir, saved, files_once.Net
        )
