"""Recovery from a killed process, and strategies custom_fit refuses."""

import concurrent.futures
import os
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

from tests import testing

_SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")
_TIMEOUT = 240


def script(name, *arguments):
    return [sys.executable, os.path.join(_SCRIPTS, name), *arguments]


def run(command):
    """Runs `command`; returns its stdout, or fails with its stderr's end."""
    try:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT,
            check=False,
        )
    except subprocess.TimeoutExpired as error:
        # subprocess.run killed it; POSIX leaves the partial output as bytes.
        stderr = (error.stderr or b"").decode(errors="replace")
        raise AssertionError(
            f"{command} timed out after {_TIMEOUT} s:\n{stderr[-4000:]}"
        ) from None
    if result.returncode != 0:
        raise AssertionError(result.stderr[-4000:])
    return result.stdout


class RecoveryTest(testing.TestCase):
    def test_sigkill_mid_run_resumes_to_the_same_weights(self):
        """A run killed with SIGKILL in epoch 3 and restarted ends with the
        weights and optimizer state of an uninterrupted run."""
        directory = tempfile.mkdtemp()
        reference = os.path.join(directory, "reference.npz")
        # The uninterrupted reference runs beside the killed run (and is
        # waited for however that ends).
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reference_run = pool.submit(
                run,
                script(
                    "recovery.py",
                    os.path.join(directory, "ref_backup"),
                    reference,
                ),
            )
            output, resumed = self.killed_then_resumed(directory)
        reference_run.result()
        # It resumed after the last backup (end of epoch 1), not from 0.
        self.assertEqual(output.split(), ["epoch", "2", "epoch", "3"], output)
        expected, actual = np.load(reference), np.load(resumed)
        self.assertEqual(expected.files, actual.files)
        # Not bitwise: a fresh process may differ in the last bit of a few
        # weights (seen once in about ten runs, 3e-8). Losing the optimizer
        # state or a batch on resume moves the weights by ~1e-3.
        for key in expected.files:
            self.assertAllClose(actual[key], expected[key], atol=1e-6)

    def killed_then_resumed(self, directory):
        """Runs recovery.py, kills it with SIGKILL in epoch 3, runs it again
        from its backup; returns what the resumed run printed and the path
        of the weights it saved."""
        backup = os.path.join(directory, "backup")
        os.makedirs(backup)
        process = subprocess.Popen(
            script(
                "recovery.py",
                backup,
                os.path.join(directory, "x.npz"),
                "--pause-at",
                "2,2",
            ),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + _TIMEOUT
            marker = os.path.join(backup, "paused")
            while not os.path.exists(marker):
                self.assertIsNone(process.poll(), "the run ended early")
                self.assertLess(time.monotonic(), deadline, "never paused")
                time.sleep(0.2)
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
        self.assertEqual(process.returncode, -signal.SIGKILL, "not killed")

        resumed = os.path.join(directory, "resumed.npz")
        output = run(script("recovery.py", backup, resumed))
        return output, resumed


class ParameterServerTest(testing.TestCase):
    @pytest.mark.tensorflow  # a tf.distribute strategy
    def test_parameter_server_strategy_gets_a_clear_error(self):
        """Keras 3's fit cannot run under ParameterServerStrategy; a mixin
        model says so at construction, naming the strategy and the fix."""
        plain = run(script("parameter_server.py", "plain")).splitlines()[-1]
        self.assertIn("create_per_worker_dataset", plain)  # Keras' own error
        mixin = run(script("parameter_server.py", "mixin")).splitlines()[-1]
        self.assertIn("cannot train under ParameterServerStrategy", mixin)
        self.assertIn("Received: strategy=ParameterServerStrategy", mixin)
