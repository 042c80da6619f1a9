"""Smoke test: the benchmark entry point runs (no timing is asserted)."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

from tests import testing

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class BenchmarkSmokeTest(testing.TestCase):
    def run_benchmark(self, script, *flags):
        """Runs `benchmarks/<script>` on this backend with `flags`, asserts
        that it succeeds, and returns what it printed."""
        result = subprocess.run(
            [
                sys.executable,
                os.path.join(_ROOT, "benchmarks", script),
                f"--backends={testing.BACKEND}",
                *flags,
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        return result.stdout

    def test_entry_point_prints_a_table(self):
        """A two-step run on this backend prints one row per configuration,
        and the summary against the targets; on JAX with memory (a process
        per configuration: two of them here; the measurement is the same
        code on every backend, and each process imports the backend, with
        Keras and custom_fit: 6.5 s on JAX, 11-13 s on TensorFlow and
        PyTorch)."""
        memory = testing.BACKEND == "jax"
        stdout = self.run_benchmark(
            "train_step_overhead.py",
            "--workloads=mlp",
            "--rounds=1",
            "--steps=2",
            "--steps_per_execution=1",
            # On PyTorch eager: compiling costs seconds per model.
            "--jit_compile="
            + ("false" if testing.BACKEND == "torch" else "true"),
            "--configurations=keras,stacked",
            *(["--memory"] if memory else []),
        )
        setting, summary = stdout.split(f"## {testing.BACKEND} summary")
        rows = [
            [cell.strip() for cell in line.split("|")]
            for line in setting.splitlines()
            if line.startswith("| ") and "configuration" not in line
        ]
        self.assertEqual([row[1] for row in rows], ["keras", "stacked"])
        self.assertEqual(rows[0][3], "1.00")  # keras against itself
        if memory:
            self.assertGreater(float(rows[1][6]), 100)  # peak memory in MB
        else:
            self.assertEqual(len(rows[1]), 7)  # no memory column
        # The summary puts the stacked configuration next to its target.
        self.assertRegex(summary, r"\| stacked \| [0-9.]+ \((ok|over) 1.15\)")

    def test_gpu_step_prints_a_table(self):
        """The GPU benchmark's code, on a GPT-2 small enough for a CPU
        (`--size=tiny`): one row per configuration, plain Keras against
        itself 1.000, a written JSON file with the same figures. On
        PyTorch only (eager: no compilation), one of the two backends it
        measures: its code is the same for both but for reading the
        device's name and memory."""
        if testing.BACKEND != "torch":
            self.skipTest("run on PyTorch, which compiles nothing")
        testing.import_keras_hub()
        output = os.path.join(tempfile.mkdtemp(), "gpu.json")
        stdout = self.run_benchmark(
            "gpu_step.py",
            "--size=tiny",
            "--configurations=keras,guarded_stack",
            "--steps=3",
            "--rounds=1",
            "--warmup=1",
            f"--output={output}",
        )
        rows = [
            [cell.strip() for cell in line.strip("|").split("|")]
            for line in stdout.splitlines()
            if line.startswith("| ") and "configuration" not in line
        ]
        self.assertEqual([row[0] for row in rows], ["keras", "guarded_stack"])
        self.assertEqual(rows[0][2], "1.000")
        with open(output) as file:
            (written,) = json.load(file)
        self.assertEqual(written["backend"], testing.BACKEND)
        self.assertEqual(written["failed"], {})
        self.assertEqual(set(written["ratio"]), {"keras", "guarded_stack"})

    @pytest.mark.jax
    def test_model_parallel_memory_prints_a_table(self):
        """A tiny MLP on the 2x4 mesh prints one row per configuration, the
        baselines added first; plain Keras against itself is 1.00, every
        step compiled once, and accumulation's state per device is about
        that of the weight shards (not the 4x of replicated sums)."""
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)  # the script forces its 8 devices
        result = subprocess.run(
            [
                sys.executable,
                os.path.join(_ROOT, "benchmarks", "model_parallel_memory.py"),
                "--features=8",
                "--width=8",
                "--classes=4",
                "--batch_size=8",
                "--steps=2",
                "--configurations=keras_again,accumulation_4,pcgrad",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
            env=env,
        )
        self.assertEqual(result.returncode, 0, result.stderr[-3000:])
        table = [
            [cell.strip() for cell in line.strip("|").split("|")]
            for line in result.stdout.splitlines()
            if line.startswith("| ")
        ]
        header = table[0]
        rows = {cells[0]: dict(zip(header, cells)) for cells in table[1:]}
        self.assertEqual(
            list(rows),
            [
                "keras",
                "keras_two_heads",
                "keras_again",
                "accumulation_4",
                "pcgrad",
            ],
        )
        self.assertIn("of 8 host devices", result.stdout)
        for name in ("keras", "keras_again", "keras_two_heads"):
            self.assertEqual(rows[name]["scratch vs keras"], "1.00")
            self.assertEqual(rows[name]["arguments vs keras"], "1.00")
        for row in rows.values():
            self.assertEqual(row["compilations"], "1")
        # The sums, sharded as the weights, and a counter.
        state = float(rows["accumulation_4"]["state / weights"])
        self.assertBetween(state, 1.0, 1.1)
