"""JAX over two processes on 127.0.0.1: keras.distribution, CPU gloo."""

import concurrent.futures
import os
import tempfile

import numpy as np
import pytest
from tensorboard.util import tensor_util

from tests import testing
from tests.callbacks_test import event_tags

_EXAMPLE = os.path.join(testing.EXAMPLES_DIR, "jax_multi_process.py")
_HOSTS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "scripts",
    "model_parallel_hosts.py",
)
_PRIVATE = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "scripts",
    "jax_private_processes.py",
)
_LAYERS = ("hidden_1", "hidden_2", "logits")
_TIMEOUT = 420  # seconds for the whole run, processes included


def _private_runs():
    """Runs jax_private_processes.py in two processes, then in one.

    Returns:
        The output directory, and the arrays each run saved by label.
    """
    output_dir = tempfile.mkdtemp()
    env = dict(os.environ, KERAS_BACKEND="jax")
    env.pop("XLA_FLAGS", None)  # one device per process
    testing.run_bounded_together(
        *(
            (
                _PRIVATE,
                f"--processes={count}",
                f"--output_dir={output_dir}",
                "--timeout=360",
                {"timeout": _TIMEOUT, "env": env},
            )
            for count in (2, 1)
        )
    )
    return output_dir, {
        label: dict(np.load(os.path.join(output_dir, f"{label}.npz")))
        for label in ("process_0", "process_1", "single")
    }


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
        outputs = testing.run_bounded_together(
            *(
                (
                    _EXAMPLE,
                    f"--processes={count}",
                    *common,
                    {"timeout": _TIMEOUT, "env": env},
                )
                for count in (2, 1)
            )
        )
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

    def _check_keras_sharding(self, saved):
        """Keras' sharding of a `PyDataset` over the two processes
        (`auto_shard_dataset = True`): from Keras 3.16, which deals its
        batches to the processes in turn, 6 batches of 16 train both
        processes to the weights of one process fed the arrays in batches
        of 32 (atol 1e-6); before, Keras refuses it. 5 batches (a process
        would wait at the last step) and a short last batch (a global batch
        of unequal shares) are refused by custom_fit on every Keras."""
        single = saved["single"]
        at_least_3_16 = testing.keras_at_least((3, 16))
        for label in ("process_0", "process_1"):
            run = saved[label]
            self.assertEqual(float(run["refused_odd_batches"]), 1.0)
            self.assertEqual(float(run["refused_short_batch"]), 1.0)
            self.assertEqual(
                float(run["sharded_refused_by_keras"]), 1 - at_least_3_16
            )
            if at_least_3_16:
                for i in range(2):
                    self.assertAllClose(
                        run[f"sharded_weight_{i}"],
                        single[f"sharded_weight_{i}"],
                        atol=1e-6,
                        rtol=0,
                    )

    def test_poisson_private_training_over_two_processes(self):
        """DP-SGD with noise on a `PoissonSampler` under `DataParallel`
        over two processes, each feeding its share of every draw: weights
        equal one process fed the same draws (atol 1e-6), the epsilon
        logged is dp-accounting's for the sampler's rate, the shares of 500
        draws make one Poisson draw each (chi-square), samplers with a seed
        per process are refused, and so is the sampler with Keras' own
        sharding on (`auto_shard_dataset = True`: custom_fit's error, before
        Keras 3.16 would deal whole batches of different draws); without
        seeds, the processes share process 0's secret ones; a canary model
        counts each example at most once per update of accumulated Poisson
        draws. And from the same runs (one test: the two processes' run
        is the suite's longest, and two tests of it on two xdist workers
        would run it twice): Keras' writing callbacks, `GradientTensorBoard`,
        `GradientNormHistory.to_csv` and `BackupAndRestore`, given to both
        processes (the script's last runs): process 0 writes what one
        process writes, process 1 nothing (every process runs the
        callbacks: Keras' state sync before a save is collective), and a
        run resumed from the backup ends where one process ends."""
        from tests.privacy_test import dp_accounting_epsilon
        from tests.scripts import files_once

        output_dir, saved = _private_runs()
        testing.check_files_written_once(
            self, output_dir, saved, files_once.Net
        )
        single = saved["single"]
        expected = [
            dp_accounting_epsilon(4 * epochs, 32 / 119, 1.0, 1e-3)
            for epochs in (1, 2, 3)
        ]
        for label, run in saved.items():
            self.assertAllClose(run["epsilon"], expected, rtol=1e-6)
            refused = 0 if label == "single" else 1
            self.assertEqual(float(run["refused_seed"]), refused, label)
            self.assertEqual(float(run["refused_auto_shard"]), refused)
            for i in range(4):
                self.assertAllClose(
                    run[f"weight_{i}"], single[f"weight_{i}"], atol=1e-6
                )
        self._check_keras_sharding(saved)
        # A CanaryAudit: with given seeds its figures equal one process'
        # (the canaries dealt as examples are), every check passed; with
        # secret seeds both processes report the same audit.
        self.assertEqual(single["audit_figures"][-1], 1.0)
        for label in ("process_0", "process_1"):
            self.assertAllClose(
                saved[label]["audit_figures"], single["audit_figures"],
                atol=1e-5,
            )
            self.assertEqual(saved[label]["audit_secret_figures"][-1], 1.0)
        self.assertAllClose(
            saved["process_1"]["audit_secret_figures"],
            saved["process_0"]["audit_secret_figures"],
            atol=1e-6,
        )
        # Gradient-space count: every update holds every example 0 or 1
        # times, over two processes as in one.
        for label, run in saved.items():
            entries = run["canary_entries"]
            self.assertGreater(len(entries), 10, label)
            self.assertAllClose(entries, np.round(entries), atol=1e-3, rtol=0)
            self.assertLessEqual(float(np.round(entries).max()), 1.0, label)
            self.assertGreaterEqual(float(np.round(entries).min()), 0.0)
        # Secret seeds (noise and sampler): process 0's in both processes,
        # another draw in the single process.
        for i in range(4):
            self.assertAllClose(
                saved["process_1"][f"secret_weight_{i}"],
                saved["process_0"][f"secret_weight_{i}"],
                atol=1e-6,
            )
        self.assertGreater(
            max(
                np.abs(
                    saved["process_0"][f"secret_weight_{i}"]
                    - single[f"secret_weight_{i}"]
                ).max()
                for i in range(4)
            ),
            1e-3,
        )
        testing.assert_one_poisson_draw(
            self,
            [saved[f"process_{i}"]["taken"] for i in (0, 1)],
            [saved[f"process_{i}"]["rows"] for i in (0, 1)],
            single["taken"],
            rate=0.1,
        )

    def test_model_parallel_reads_agree_across_processes(self):
        """ModelParallel on a 2x4 mesh whose model axis spans two processes,
        with clipping, accumulation and kept gradients: the gradient figures
        read mid-epoch from a closure and through a callback's `self.model`,
        after `fit`, and by custom_fit's callbacks, are the same in both
        processes and equal (atol 1e-6) to one process on the same mesh and
        to one device (the oracle); `GradientTensorBoard` writes its events
        from process 0 only."""
        output_dir = tempfile.mkdtemp()
        env = dict(os.environ, KERAS_BACKEND="jax")
        env.pop("XLA_FLAGS", None)  # the script forces its own devices
        runs = [f"--processes={count}" for count in (2, 1)]
        with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
            list(
                pool.map(
                    lambda run: testing.run_bounded(
                        _HOSTS,
                        run,
                        f"--output_dir={output_dir}",
                        "--timeout=400",
                        timeout=_TIMEOUT,
                        env=env,
                    ),
                    runs,
                )
            )
        labels = ("process_0", "process_1", "devices_8", "devices_1")
        saved = {
            label: dict(np.load(os.path.join(output_dir, f"{label}.npz")))
            for label in labels
        }
        oracle = saved["devices_1"]
        self.assertEqual(oracle["kernel_devices"], 1)
        for label in labels[:3]:
            # Each row of the mesh splits a kernel over devices of both
            # processes (in one process, of that one).
            processes = [[0, 1]] * 2 if label != "devices_8" else [[0]] * 2
            self.assertEqual(
                saved[label].pop("model_axis_processes").tolist(), processes
            )
            self.assertEqual(saved[label]["kernel_devices"], 8)
            saved[label]["kernel_devices"] = oracle["kernel_devices"]
        for label in labels[:3]:
            self.assertEqual(sorted(saved[label]), sorted(oracle), label)
            for key, value in oracle.items():
                self.assertAllClose(
                    saved[label][key], value, atol=1e-6, rtol=0, msg=key
                )
                if label == "process_1":  # the same arrays, whole
                    np.testing.assert_array_equal(
                        saved[label][key], saved["process_0"][key]
                    )
        self._check_reads(saved["process_1"])
        for label in labels:
            if label == "process_1":  # files are written by process 0 only
                self.assertFalse(
                    os.path.exists(os.path.join(output_dir, f"logs_{label}"))
                )
            else:
                self._check_event_files(output_dir, label, oracle)

    def _check_reads(self, saved):
        """The reads are of the trained step: a closure reads what a
        callback's `self.model` reads, `fit` ends with the last batch's
        figures, the norms are those of the kept gradients, and the
        history keeps the norm of every update."""
        batches = 96 // 16
        last = f"1/{batches - 1}"
        for key in [k for k in saved if k.startswith(f"closure/{last}/")]:
            name = key[len(f"closure/{last}/") :]
            self.assertAllClose(saved[f"callback/{last}/{name}"], saved[key])
            self.assertAllClose(saved[f"after_fit/{name}"], saved[key])
        for layer in _LAYERS:
            kept = [
                saved[f"after_fit/layer_gradients/{layer}/{i}"] for i in (0, 1)
            ]
            self.assertAllClose(
                saved[f"after_fit/gradient_norms/{layer}"],
                np.sqrt(sum(np.sum(np.square(g)) for g in kept)),
                atol=1e-6,
                rtol=1e-5,
            )
            self.assertGreater(saved[f"after_fit/gradient_norms/{layer}"], 0)
            # Every second batch ends an accumulation and is inspected.
            self.assertAllClose(
                saved[f"history/{layer}"],
                [
                    saved[f"closure/{epoch}/{batch}/gradient_norms/{layer}"]
                    for epoch in (0, 1)
                    for batch in range(1, batches, 2)
                ],
            )
        self.assertEqual(saved["history/steps"].tolist(), list(range(1, 7)))

    def _check_event_files(self, output_dir, label, oracle):
        """GradientTensorBoard wrote every layer's norms (as the oracle's
        history has them) and histograms in this run's own directory."""
        accumulator, tags = event_tags(
            os.path.join(output_dir, f"logs_{label}", "train")
        )
        expected = {f"grad_norm_step/{layer}" for layer in _LAYERS}
        expected |= {f"gradients/{layer}" for layer in _LAYERS}
        self.assertEqual(tags, expected)
        for layer in _LAYERS:
            events = accumulator.Tensors(f"grad_norm_step/{layer}")
            self.assertEqual(
                [event.step for event in events], list(range(1, 7))
            )
            self.assertAllClose(
                [
                    float(tensor_util.make_ndarray(e.tensor_proto))
                    for e in events
                ],
                oracle[f"history/{layer}"],
            )
