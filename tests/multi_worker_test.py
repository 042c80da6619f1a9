"""MultiWorkerMirroredStrategy: two worker processes on 127.0.0.1."""

import os
import signal
import subprocess
import sys
import tempfile

import numpy as np

from tests import testing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_EXAMPLE = os.path.join(_ROOT, "examples", "multi_worker.py")
_TIMEOUT = 420  # seconds for the whole run, workers included


def run_bounded(*flags):
    """Runs the multi-worker example in its own process group; kills the
    whole group (launcher and workers) when it ends, however it ends."""
    process = subprocess.Popen(
        [sys.executable, _EXAMPLE, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=_TIMEOUT)
    except subprocess.TimeoutExpired:
        kill_group(process)
        output, _ = process.communicate()  # what it printed until killed
        raise AssertionError(
            f"{flags} timed out after {_TIMEOUT} s:\n{output[-4000:]}"
        ) from None
    finally:
        kill_group(process)  # workers outlive a launcher killed by a signal
    if process.returncode != 0:
        raise AssertionError(f"{flags} failed:\n{output[-4000:]}")
    return output


def kill_group(process):
    """Kills the process group `process` leads, then reaps `process`."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the whole group has exited
    process.wait()


class MultiWorkerTest(testing.TestCase):
    def test_two_workers_equal_single_process(self):
        """Both workers end with identical weights, equal (atol 1e-6) to a
        single process with the same global batch; clipping and inspection
        are on."""
        output_dir = tempfile.mkdtemp()
        common = ["--epochs=2", f"--output_dir={output_dir}", "--timeout=360"]
        output = run_bounded("--workers=2", *common)
        self.assertIn("validation accuracy", output)
        run_bounded("--workers=1", *common)
        workers = [
            np.load(os.path.join(output_dir, f"worker_{i}.npz")) for i in (0, 1)
        ]
        single = np.load(os.path.join(output_dir, "single.npz"))
        for key in single.files:
            self.assertAllClose(
                workers[0][key], workers[1][key], atol=0, rtol=0
            )
            self.assertAllClose(workers[0][key], single[key], atol=1e-6, rtol=0)
