"""PyTorch over two torch.distributed processes on 127.0.0.1 (gloo).

The processes are launched as a user launches them, with `torchrun`
(`python -m torch.distributed.run`), bounded by a timeout and reaped with
their launcher (`testing.run_bounded`). The oracle is one process fitting
the same global batches.
"""

import os
import socket
import tempfile

import keras
import numpy as np
import pytest

import custom_fit
from tests import testing

_SCRIPT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "scripts", "torch_processes.py"
)
_TIMEOUT = 300  # seconds for a whole run, processes included
# Each process normalizes by its own batch, or draws its own dropout masks:
# these differ from one process.
_PER_PROCESS_STATISTICS = ("batch_normalization", "dropout")
# A secret noise seed, drawn anew by every run: the processes are compared
# with each other only.
_SECRET = ("dp_secret_seed", "poisson_secret")


class _Net(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    custom_fit.RegularizationMixin,
    keras.Model,
):
    """The script's `Net`, to load its checkpoint."""


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun_args(*flags, processes=2, script=_SCRIPT):
    """The `run_bounded` arguments of `script` under torchrun with
    `processes` gloo processes."""
    env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
    return (
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={processes}",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        script,
        *flags,
        {"timeout": _TIMEOUT, "env": env},
    )


def _torchrun(*flags, processes=2, script=_SCRIPT):
    """Runs `script` under torchrun with `processes` gloo processes."""
    (output,) = testing.run_bounded_together(
        _torchrun_args(*flags, processes=processes, script=script)
    )
    return output


@pytest.mark.torch
class TorchDataParallelExampleTest(testing.TestCase):
    def test_two_processes_equal_one_with_a_distributed_sampler(self):
        """`examples/torch_data_parallel.py` under torchrun: a shuffling
        `DistributedSampler` over 3 epochs (its epoch set by `fit`), and
        the weights, the loss per epoch and the validation accuracy of
        process 0 equal one process on the same global batches."""
        output_dir = tempfile.mkdtemp()
        example = os.path.join(testing.EXAMPLES_DIR, "torch_data_parallel.py")
        flags = (f"--output_dir={output_dir}", "--epochs=3")
        env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
        _torchrun(*flags, script=example)
        testing.run_bounded(example, *flags, timeout=_TIMEOUT, env=env)
        two, one = (
            np.load(os.path.join(output_dir, f"processes_{n}.npz"))
            for n in (2, 1)
        )
        # The sampler was told the epochs (by custom_fit up to Keras 3.15,
        # which leaves it at the last, 2; by Keras' adapter from 3.16, which
        # tells it one more after the last), as in one process.
        self.assertEqual(
            int(two["sampler_epoch"]),
            3 if testing.keras_at_least((3, 16)) else 2,
        )
        self.assertEqual(int(two["sampler_epoch"]), int(one["sampler_epoch"]))
        for key in one.files:
            self.assertAllClose(two[key], one[key], atol=1e-6, rtol=0, msg=key)


@pytest.mark.torch
class TorchProcessesTest(testing.TestCase):
    def assert_processes_agree_unlike_one(self, configuration):
        """Asserts both processes end on the same weights (atol 1e-6),
        which differ from the single process' (by more than 1e-3): secret
        seeds of process 0's, another secret in the single process."""
        keys = [
            k
            for k in self.saved["single"]
            if k.startswith(f"{configuration}/weight_")
        ]
        self.assertNotEmpty(keys)
        for key in keys:
            self.assertAllClose(
                self.saved["process_1"][key],
                self.saved["process_0"][key],
                atol=1e-6,
                rtol=0,
                msg=key,
            )
        difference = max(
            np.abs(self.saved["process_0"][k] - self.saved["single"][k]).max()
            for k in keys
        )
        self.assertGreater(difference, 1e-3)

    @classmethod
    def setUpClass(cls):
        """Fits every configuration in two processes and in one, at once."""
        super().setUpClass()
        cls.output_dir = tempfile.mkdtemp()
        env = dict(os.environ, KERAS_BACKEND="torch", OMP_NUM_THREADS="1")
        testing.run_bounded_together(
            _torchrun_args(f"--output_dir={cls.output_dir}"),
            (
                _SCRIPT,
                f"--output_dir={cls.output_dir}",
                {"timeout": _TIMEOUT, "env": env},
            ),
        )
        cls.saved = {
            label: dict(np.load(os.path.join(cls.output_dir, f"{label}.npz")))
            for label in ("process_0", "process_1", "single")
        }

    def configurations(self):
        return sorted(
            {
                key.split("/")[0]
                for key in self.saved["single"]
                if "/weight_" in key
            }
        )

    def test_every_mixin_family_equals_one_process(self):
        """Clipping + inspection + L2, the guard (a NaN in one process'
        shard) with a spike bound, accumulation, SAM, PCGrad, parameter
        groups and DP-SGD with noise (ghost and vectorized): the final
        weights equal one process on the global batches (atol 1e-6), from
        weights each process initialized with its own seed, with an uneven
        last batch (12 + 11 rows)."""
        single = self.saved["single"]
        names = self.configurations()
        self.assertGreaterEqual(len(names), 9)
        for name in names:
            if name in _PER_PROCESS_STATISTICS + _SECRET:
                continue
            weights = [k for k in single if k.startswith(f"{name}/weight_")]
            self.assertNotEmpty(weights)
            for key in weights:
                self.assertAllClose(
                    self.saved["process_0"][key],
                    single[key],
                    atol=1e-6,
                    rtol=0,
                    msg=key,
                )

    @pytest.mark.skipif(
        not testing.keras_at_least((3, 16)),
        reason="several steps per call on PyTorch: Keras 3.16",
    )
    def test_several_steps_per_call_from_3_16(self):
        """Keras 3.16's PyTorch trainer with `steps_per_execution=4` (the
        guard with a NaN in one process' shard, clipping, inspection): the
        weights and logs equal one process (in the tests above), and the
        callbacks see the batch indices Keras' own model shows them with 4
        steps per call on the global batches."""
        single = self.saved["single"]
        name = "steps_per_execution_4"
        self.assertIn(name, self.configurations())
        for label in ("process_0", "process_1"):
            np.testing.assert_array_equal(
                self.saved[label][f"{name}/batches_seen"],
                single[f"{name}/keras_batches_seen"],
            )

    def test_logs_equal_one_process_and_each_other(self):
        """Every History entry (training and validation, the figures
        custom_fit reports included: skipped steps and spikes, clip rate,
        per-layer norms, DP's clipped share) is the same in both processes
        and equals one process on the global batches."""
        single = self.saved["single"]
        history = [k for k in single if "/history/" in k]
        reported = {k.split("/history/")[1] for k in history}
        for expected in (
            "loss",
            "val_loss",
            "accuracy",
            "skipped_steps",
            "skipped_spikes",
            "clip_rate",
            "grad_norm/hidden",
            "dp_clipped_fraction",
        ):
            self.assertIn(expected, reported)
        for key in history:
            np.testing.assert_array_equal(
                self.saved["process_0"][key],
                self.saved["process_1"][key],
                err_msg=key,
            )
            if key.split("/")[0] in _PER_PROCESS_STATISTICS + _SECRET:
                continue
            self.assertAllClose(
                self.saved["process_0"][key],
                single[key],
                atol=1e-6,
                rtol=1e-6,
                msg=key,
            )

    def test_a_secret_noise_seed_is_process_zeros_in_both(self):
        """DP-SGD with noise and no `noise_seed`: each process draws a
        secret seed of its own, and `fit` hands process 0's to the other,
        so both end on the same weights (atol 1e-6), which differ from the
        single process' (another secret seed: other noise)."""
        self.assert_processes_agree_unlike_one("dp_secret_seed")

    def test_guard_and_spike_rule_act_in_both_processes(self):
        """The oracle run skips a NaN batch and a spike in the first epoch,
        so the equality above covers a skipped step of each kind."""
        single = self.saved["single"]
        self.assertEqual(
            single["guard_spike/history/skipped_steps"].tolist(), [2.0, 1.0]
        )
        self.assertEqual(
            single["guard_spike/history/skipped_spikes"].tolist(), [1.0, 0.0]
        )

    def test_early_stopping_stops_every_process_at_the_same_epoch(self):
        """`EarlyStopping` on `val_loss` (min_delta 0.01) stops both
        processes after the epoch one process stops after, before the 12
        asked for: they decide on the same, global logs."""
        key = "clipping_inspection_l2/history/val_loss"
        epochs = len(self.saved["single"][key])
        self.assertLess(epochs, 12)
        for label in ("process_0", "process_1"):
            self.assertLen(self.saved[label][key], epochs)

    def test_gradient_tensorboard_writes_in_the_first_process_only(self):
        """Process 0 writes the events one process writes (read back with
        TensorBoard's reader); process 1 writes nothing."""
        from tensorboard.util import tensor_util

        from tests.callbacks_test import event_tags

        self.assertFalse(
            os.path.exists(os.path.join(self.output_dir, "tb_process_1"))
        )
        read = {}
        for label in ("process_0", "single"):
            accumulator, tags = event_tags(
                os.path.join(self.output_dir, f"tb_{label}", "train")
            )
            self.assertEqual(
                tags, {"grad_norm_step/hidden", "grad_norm_step/logits_0"}
            )
            read[label] = [
                (e.step, float(tensor_util.make_ndarray(e.tensor_proto)))
                for e in accumulator.Tensors("grad_norm_step/hidden")
            ]
        self.assertEqual(
            [s for s, _ in read["process_0"]], [s for s, _ in read["single"]]
        )
        self.assertAllClose(
            [v for _, v in read["process_0"]],
            [v for _, v in read["single"]],
            atol=1e-6,
        )

    def test_keras_writing_callbacks_write_in_the_first_process_only(self):
        """`CSVLogger` and `ModelCheckpoint` given to both processes write
        from process 0 only: its CSV rows equal one process' (1e-6), and
        its checkpoint loads with the final weights of both processes."""
        directory = self.output_dir
        for name in ("log_process_1.csv", "checkpoint_process_1.keras"):
            self.assertFalse(os.path.exists(os.path.join(directory, name)))
        rows = {
            label: np.genfromtxt(
                os.path.join(directory, f"log_{label}.csv"),
                delimiter=",",
                names=True,
            )
            for label in ("process_0", "single")
        }
        self.assertEqual(
            rows["process_0"].dtype.names, rows["single"].dtype.names
        )
        for name in rows["single"].dtype.names:
            self.assertAllClose(
                rows["process_0"][name], rows["single"][name], atol=1e-6
            )
        loaded = keras.saving.load_model(
            os.path.join(directory, "checkpoint_process_0.keras"),
            custom_objects={"Net": _Net},
        )
        prefix = "clipping_inspection_l2/weight_"
        for i, weight in enumerate(loaded.get_weights()):
            self.assertAllClose(
                weight, self.saved["process_1"][f"{prefix}{i}"], atol=0
            )

    def test_no_second_reduction_when_wrapped_as_keras_3_16_wraps(self):
        """A model wrapped in `DistributedDataParallel` with Keras 3.16's
        metric summing below custom_fit (configuration `keras_3_16_ddp`,
        clipping, inspection and the guard on a NaN batch): weights, logs
        (the skipped-step count included), `evaluate` over shards and
        `predict` through the wrapper equal one process: nothing is reduced
        twice."""
        single = self.saved["single"]
        self.assertEqual(
            float(self.saved["process_0"]["keras_3_16_ddp/wrapped"]), 1
        )
        self.assertEqual(float(single["keras_3_16_ddp/wrapped"]), 0)
        self.assertEqual(
            single["keras_3_16_ddp/history/skipped_steps"].tolist(), [1.0, 1.0]
        )
        keys = [
            k
            for k in single
            if k.startswith("keras_3_16_ddp/") and not k.endswith("/wrapped")
        ]
        self.assertLen([k for k in keys if "/weight_" in k], 4)
        for key in keys:
            for label in ("process_0", "process_1"):
                self.assertAllClose(
                    self.saved[label][key], single[key], atol=1e-6, msg=key
                )

    def test_backup_and_restore_resumes_every_process_at_the_same_epoch(
        self,
    ):
        """`BackupAndRestore` given to both processes, in one directory: a
        fit interrupted as its third of 4 epochs begins, then resumed by a
        new model, runs the 2 remaining epochs in both processes, ends with
        one process' weights (the same flow in one process), and the backup
        is removed at the end (only the first process writes and deletes)."""
        single = self.saved["single"]
        for label in ("process_0", "process_1", "single"):
            self.assertEqual(float(self.saved[label]["backup/epochs_run"]), 2)
            self.assertEqual(float(self.saved[label]["backup/removed"]), 1)
            for i in range(4):
                key = f"backup/weight_{i}"
                self.assertAllClose(
                    self.saved[label][key], single[key], atol=1e-6, rtol=0
                )

    def test_poisson_private_training_equals_one_process(self):
        """DP-SGD with noise on a `PoissonSampler` of the whole data (the
        same seed in both processes, each feeding its share of every draw):
        weights equal one process fed the same draws (atol 1e-6), and the
        epsilon logged in every process is dp-accounting's for the
        sampler's rate, 32 / 119, over the 12 steps run."""
        from tests.privacy_test import dp_accounting_epsilon

        single = self.saved["single"]
        expected = [
            dp_accounting_epsilon(4 * epochs, 32 / 119, 1.0, 1e-3)
            for epochs in (1, 2, 3)
        ]
        for label in ("process_0", "process_1", "single"):
            self.assertAllClose(
                self.saved[label]["poisson/epsilon"], expected, rtol=1e-6
            )
        keys = [k for k in single if k.startswith("poisson/weight_")]
        self.assertLen(keys, 4)
        for key in keys:
            self.assertAllClose(
                self.saved["process_0"][key], single[key], atol=1e-6, rtol=0
            )

    def test_an_audited_run_equals_one_process(self):
        """The Poisson run above, audited by a `CanaryAudit` (canaries dealt
        to the processes as examples are): with given seeds every figure
        of the audit equals one process fed the same draws (the canaries'
        slot summed over the processes once), every check passes; with
        secret seeds (one epoch) both processes report the same audit."""
        single = self.saved["single"]["audit/figures"]
        self.assertEqual(single[-1], 1.0)  # every check passed
        self.assertEqual(single[-4], 12)  # updates
        for label in ("process_0", "process_1"):
            self.assertAllClose(
                self.saved[label]["audit/figures"], single, atol=1e-5
            )
            self.assertEqual(self.saved[label]["audit_secret/figures"][-1], 1)
        self.assertAllClose(
            self.saved["process_1"]["audit_secret/figures"],
            self.saved["process_0"]["audit_secret/figures"],
            atol=1e-6,
        )

    def test_secret_seeds_of_noise_and_sampler_are_process_zeros(self):
        """DP-SGD on a `PoissonSampler`, neither the noise nor the sampler
        given a seed: each process draws its own secret seeds, and `fit`
        hands process 0's to the other, so both train on the same draws
        with the same noise and end equal (atol 1e-6), unlike the single
        process (other secret seeds)."""
        self.assert_processes_agree_unlike_one("poisson_secret")

    def test_accumulated_poisson_draws_hold_each_example_once(self):
        """Gradient-space count over two processes: with a sampler that
        deals each draw into 2 batches (each process its share of each),
        every update holds every example 0 or 1 times, in both processes
        and in one."""
        for label in ("process_0", "process_1", "single"):
            entries = self.saved[label]["canary/entries"]
            self.assertGreater(len(entries), 10, label)
            self.assertAllClose(
                entries, np.round(entries), atol=1e-3, rtol=0, msg=label
            )
            self.assertLessEqual(float(np.round(entries).max()), 1.0, label)
            self.assertGreaterEqual(float(np.round(entries).min()), 0.0, label)
        self.assertAllClose(
            self.saved["process_0"]["canary/entries"],
            self.saved["process_1"]["canary/entries"],
            atol=1e-6,
        )

    def test_poisson_samplers_that_differ_are_refused(self):
        """Over two processes, samplers with a seed of their own, with each
        process' own data, fitted with `shuffle=True`, or a sampler in one
        process and arrays in the other are refused in both processes
        before the first step (none waits in a collective); one process
        trains."""
        for name in ("seed", "data", "shuffle", "mixed"):
            key = f"refused/poisson_{name}"
            for label in ("process_0", "process_1"):
                self.assertEqual(float(self.saved[label][key]), 1, key)
            self.assertEqual(float(self.saved["single"][key]), 0, key)

    def test_keras_own_wrapper_wraps_every_model_from_3_16(self):
        """From Keras 3.16 its trainer wraps every model of the processes
        in `DistributedDataParallel` (none before, none in one process), so
        the configurations' equality with one process is that of custom_fit
        under Keras' own wrapper: nothing reduced twice."""
        expected = float(testing.keras_at_least((3, 16)))
        for label in ("process_0", "process_1", "single"):
            own = np.load(os.path.join(self.output_dir, f"{label}_own.npz"))
            wrapped = {
                k: float(own[k]) for k in own.files if k.endswith("/wrapped")
                or k.endswith("/keras_wrapped")
            }
            self.assertGreater(len(wrapped), 10)
            for key, value in wrapped.items():
                if key.startswith("keras_3_16_ddp/"):
                    continue
                self.assertEqual(
                    value, expected if label != "single" else 0.0, key
                )

    def test_poisson_shares_make_one_poisson_draw(self):
        """Over 500 steps of a sampler of 400 examples (q = 0.1), the
        processes' shares are disjoint, have equal rows, and together are
        one process' draw; each example's inclusion count over the steps
        fits Binomial(500, 0.1) (a chi-square test over the 400 examples),
        and the global batch size varies as Binomial(400, 0.1) does (not a
        fixed batch)."""
        shares = {
            label: np.load(os.path.join(self.output_dir, f"{label}_own.npz"))
            for label in ("process_0", "process_1", "single")
        }
        testing.assert_one_poisson_draw(
            self,
            [shares[f"process_{i}"]["taken"] for i in (0, 1)],
            [shares[f"process_{i}"]["rows"] for i in (0, 1)],
            shares["single"]["taken"],
            rate=0.1,
        )

    def test_unequal_batch_counts_are_refused_before_the_first_step(self):
        """Shares of 4 and 2 batches per epoch: `fit` raises in both
        processes before any step (not a hang in a collective); one process
        trains."""
        for label in ("process_0", "process_1"):
            self.assertEqual(float(self.saved[label]["refused/unequal"]), 1)
        self.assertEqual(float(self.saved["single"]["refused/unequal"]), 0)

    def test_a_killed_process_ends_the_run(self):
        """Process 1 dies at its third batch of a 20-epoch fit: the run ends
        with an error well within its timeout, not a hang."""
        with self.assertRaisesRegex(AssertionError, "failed") as caught:
            _torchrun(f"--output_dir={self.output_dir}", "--kill_rank=1")
        self.assertNotIn("timed out", str(caught.exception))

    def test_dropout_draws_its_own_masks_in_each_process(self):
        """The processes start from the first process' model, seed
        generators included, yet a dropout layer's next masks differ
        between them (example i of each share gets its own mask, as in
        one process on the global batch), while their weights stay equal
        (`test_processes_hold_the_same_model`)."""
        masks = [
            np.load(os.path.join(self.output_dir, f"process_{i}_own.npz"))[
                "dropout/mask"
            ]
            for i in (0, 1)
        ]
        self.assertEqual(masks[0].shape, (16, 8))
        self.assertGreater(np.mean((masks[0] == 0) != (masks[1] == 0)), 0.25)
        self.assertIn("dropout", self.configurations())

    def test_processes_hold_the_same_model(self):
        """After every step the processes hold the same model, batch
        normalization's moving statistics included (averaged over the
        processes); the trainables of per-process normalization differ
        from one process, as measured in BUILD_NOTES."""
        for key in self.saved["single"]:
            np.testing.assert_array_equal(
                self.saved["process_0"][key],
                self.saved["process_1"][key],
                err_msg=key,
            )


@pytest.mark.torch
class TorchModelParallelTest(testing.TestCase):
    def tearDown(self):
        keras.distribution.set_distribution(None)
        super().tearDown()

    def test_model_parallel_is_refused_with_its_name(self):
        """Under `keras.distribution.ModelParallel` (which Keras 3.15 sets
        on PyTorch and then trains unsharded), building a custom_fit model
        raises, naming the distribution and what to use instead."""
        mesh = keras.distribution.DeviceMesh((1,), ["batch"], ["cpu:0"])
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(
                layout_map=keras.distribution.LayoutMap(mesh),
                batch_dim_name="batch",
            )
        )
        with self.assertRaisesRegex(ValueError, "ModelParallel"):
            model = testing.mlp(_Net, global_clipnorm=1.0)
            model.compile(
                optimizer="sgd", loss="sparse_categorical_crossentropy"
            )
            model.fit(*testing.classification_data(), epochs=1, verbose=0)
