"""Smoke test: the benchmark entry point runs (no timing is asserted)."""

import os
import subprocess
import sys

from tests import testing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LOOPS = {"tensorflow": "tf_function_loop", "jax": "jax_jit_loop"}


class BenchmarkSmokeTest(testing.TestCase):
    def test_entry_point_prints_a_table(self):
        """A two-step run on this backend prints one row per configuration,
        with memory, and the summary against the targets."""
        loop = _LOOPS[testing.BACKEND]
        result = subprocess.run(
            [
                sys.executable,
                os.path.join(_ROOT, "benchmarks", "train_step_overhead.py"),
                f"--backends={testing.BACKEND}",
                "--workloads=mlp",
                "--rounds=1",
                "--steps=2",
                "--steps_per_execution=1",
                "--jit_compile=true",
                f"--configurations=keras,stacked,private,{loop}",
                "--memory",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        setting, summary = result.stdout.split(f"## {testing.BACKEND} summary")
        rows = [
            [cell.strip() for cell in line.split("|")]
            for line in setting.splitlines()
            if line.startswith("| ") and "configuration" not in line
        ]
        self.assertEqual(
            [row[1] for row in rows], ["keras", "stacked", "private", loop]
        )
        self.assertEqual(rows[0][3], "1.00")  # keras against itself
        self.assertGreater(float(rows[1][6]), 100)  # peak memory in MB
        # The summary puts the stacked configuration next to its target.
        self.assertRegex(summary, r"\| stacked \| [0-9.]+ \((ok|over) 1.15\)")
