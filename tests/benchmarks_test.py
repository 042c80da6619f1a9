"""Smoke test: the benchmark entry point runs (no timing is asserted)."""

import os
import subprocess
import sys

from tests import testing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BenchmarkSmokeTest(testing.TestCase):
    def test_entry_point_prints_a_table(self):
        """A two-step run prints one table row per setting."""
        result = subprocess.run(
            [
                sys.executable,
                os.path.join(_ROOT, "benchmarks", "train_step_overhead.py"),
                "--workloads=mlp",
                "--rounds=1",
                "--steps=2",
                "--steps_per_execution=1",
                "--jit_compile=false",
            ],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        rows = [
            line for line in result.stdout.splitlines() if "| mlp |" in line
        ]
        self.assertLen(rows, 1)
        self.assertIn("(1.00x; min 1.00x)", rows[0])
