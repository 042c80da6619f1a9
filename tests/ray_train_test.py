"""Ray Train: examples/ray_train.py with two Ray workers on this machine.

Each backend's pass runs the example under its own Ray trainer
(`TensorflowTrainer`, `JaxTrainer`, `TorchTrainer`) and compares it with the
example's one-process run (`--workers=1`, no Ray) on the same global
batches. Skipped without Ray (the `ray` extra). Each run is bounded by a
timeout; Ray's processes share the launcher's process group (and die with
it), which `testing.run_bounded` kills when the run ends.
"""

import json
import os
import tempfile

import keras
import numpy as np
import pytest

from tests import testing

ray = pytest.importorskip("ray", reason="needs the `ray` extra")

_EXAMPLE = os.path.join(testing.EXAMPLES_DIR, "ray_train.py")
_TIMEOUT = 900  # seconds for a whole Ray run, its workers included (a
# restart starts a second worker group; under a loaded CI, minutes)


def run(*runs):
    """Runs the example once per tuple of flags in `runs`, all at once (the
    one-process reference beside the Ray run); returns what each printed."""
    env = dict(
        os.environ,
        RAY_USAGE_STATS_ENABLED="0",
        # Ray Train's controller checks its workers every 2 s by default
        # (a finished or crashed worker is seen up to 2 s late, twice per
        # restart), and starts a preemption watcher and metrics that a
        # local run has no use for: about 8 s per run here. (Ray Train's
        # own names, in `ray.train.v2._internal.constants` of Ray 2.60: if
        # a later Ray renames them, the runs are only slower.)
        RAY_TRAIN_HEALTH_CHECK_INTERVAL_S="0.25",
        RAY_TRAIN_ENABLE_PREEMPTION_WATCHER="0",
        RAY_TRAIN_METRICS_ENABLED="0",
    )
    keywords = {"timeout": _TIMEOUT, "env": env}
    return testing.run_bounded_together(
        *((_EXAMPLE, *flags, keywords) for flags in runs)
    )


def poisson_epsilon(rate, noise, steps, delta):
    """dp-accounting's RDP epsilon of `steps` Poisson-subsampled Gaussian
    mechanisms."""
    import dp_accounting
    from dp_accounting import rdp

    ledger = rdp.RdpAccountant()
    event = dp_accounting.PoissonSampledDpEvent(
        rate, dp_accounting.GaussianDpEvent(noise)
    )
    ledger.compose(event, steps)
    return ledger.get_epsilon(delta)


def saved(directory, worker):
    """Returns `(weights, optimizer variables, logs)` a worker saved."""
    path = os.path.join(directory, f"worker_{worker}")
    arrays = []
    for name in ("weights.npz", "optimizer.npz"):
        with np.load(os.path.join(path, name)) as handle:
            arrays.append([handle[f"arr_{i}"] for i in range(len(handle))])
    with open(os.path.join(path, "history.json")) as handle:
        return (*arrays, json.load(handle))


class RayTrainTest(testing.TestCase):
    def test_two_workers_through_a_restart_equal_one_process(self):
        """Two Ray workers, with clipping and inspection, end on the weights
        and optimizer state of one process fed the same global batches
        (atol 1e-6; the two workers bit for bit), with the same logs every
        epoch, although worker 0 died after epoch 1 and Ray restarted the
        run from the checkpoint it reported then."""
        one, two = tempfile.mkdtemp(), tempfile.mkdtemp()
        run(
            ("--workers=1", "--epochs=2", f"--output_dir={one}"),
            (
                "--workers=2",
                "--epochs=2",
                "--crash_after_epoch=1",
                f"--output_dir={two}",
            ),
        )
        # Worker 0 of the restarted run wrote the epochs its checkpoint held.
        with open(os.path.join(two, "restarted_from")) as handle:
            self.assertEqual(handle.read(), "1")
        weights, state, logs = saved(one, 0)
        workers = [saved(two, worker) for worker in (0, 1)]
        for got in workers:
            self.assertAllClose(got[0], weights, atol=1e-6, rtol=0)
            self.assertAllClose(got[1], state, atol=1e-6, rtol=0)
            self.assertEqual(sorted(got[2]), sorted(logs))
            for key, values in logs.items():
                self.assertLen(got[2][key], 2)
                self.assertAllClose(got[2][key], values, atol=1e-5, rtol=1e-5)
        for a, b in zip(workers[0][0], workers[1][0]):
            np.testing.assert_array_equal(a, b)

    def test_private_training_on_two_workers_equals_one_process(self):
        """DP-SGD on Poisson batches (`--private`, given seeds): two Ray
        workers, each feeding its share of every draw, end on the weights
        and optimizer state of one process (atol 1e-6), with the epsilon
        the accountant gives one process every epoch (dp-accounting's RDP
        epsilon of the Poisson-subsampled Gaussian, computed here), the
        same clipped fractions and (weighted) accuracy. Not on TensorFlow:
        there each worker would draw its own batches and custom_fit
        refuses the sampler before the first step, as tested over real
        `MultiWorkerMirroredStrategy` workers in `multi_worker_test.py`
        (a Ray run adds 50-90 s to the suite for the same check)."""
        if keras.backend.backend() == "tensorflow":
            self.skipTest(
                "TensorFlow refuses a PoissonSampler over several workers: "
                "tests/multi_worker_test.py::"
                "test_files_written_once_and_sampler_refused"
            )
        one, two = tempfile.mkdtemp(), tempfile.mkdtemp()
        flags = ("--epochs=2", "--private", "--seed=5")
        run(
            ("--workers=1", *flags, f"--output_dir={one}"),
            ("--workers=2", *flags, f"--output_dir={two}"),
        )
        weights, state, logs = saved(one, 0)
        steps = -(-1437 // 64)  # a pass of scikit-learn's digits' split
        expected = [
            poisson_epsilon(64 / 1437, 1.1, steps * epochs, 1e-5)
            for epochs in (1, 2)
        ]
        self.assertAllClose(logs["epsilon"], expected, rtol=1e-6, atol=0)
        for worker in (0, 1):
            got = saved(two, worker)
            self.assertAllClose(got[0], weights, atol=1e-6, rtol=0)
            self.assertAllClose(got[1], state, atol=1e-6, rtol=0)
            for key in ("epsilon", "dp_clipped_fraction", "accuracy"):
                self.assertAllClose(got[2][key], logs[key], atol=1e-6, rtol=0)

    @pytest.mark.tensorflow
    def test_a_plain_keras_model_fails_under_tensorflow_trainer(self):
        """The control: the same run with a plain `keras.Model` fails under
        Ray's `TensorflowTrainer` as Ray's own Keras 3 example does, on
        values of `tf.distribute` (`PerReplica`) that Keras' step cannot
        convert."""
        with self.assertRaisesRegex(AssertionError, "PerReplica"):
            run(("--workers=2", "--epochs=1", "--plain"))
