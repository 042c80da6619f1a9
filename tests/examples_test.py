"""Runs the examples with small flags and checks what they print.

Each example runs as a program of its own (`tests/prewarmed.py`) under
each Keras backend: the test is
parameterized over the backend, which the process gets as
`KERAS_BACKEND`, and each parameter carries that backend's marker, so the
TensorFlow pass of the suite runs the examples on TensorFlow, the JAX pass
on JAX and the PyTorch pass on PyTorch. Every example program run here
runs on the three backends unchanged (TensorBoard logs are written with
TensorFlow's `tf.summary` on each). The two that launch a cluster need one
backend by nature and are tested in files of their own (see
`TESTED_ELSEWHERE`).
"""

import csv
import functools
import math
import os
import re
import tempfile

import matplotlib
import numpy as np
import pytest
from sklearn import datasets

from tests import prewarmed
from tests import testing

matplotlib.use("Agg")
from matplotlib import pyplot  # noqa: E402

BACKENDS = pytest.mark.parametrize(
    "backend",
    [
        pytest.param("tensorflow", marks=pytest.mark.tensorflow),
        pytest.param("jax", marks=pytest.mark.jax),
        pytest.param("torch", marks=pytest.mark.torch),
    ],
)

# Example programs with a test file of their own, and why.
TESTED_ELSEWHERE = {
    # TensorFlow only: MultiWorkerMirroredStrategy over local workers.
    "multi_worker": "multi_worker_test.py",
    # JAX only: keras.distribution.initialize over local processes.
    "jax_multi_process": "jax_multi_process_test.py",
    # A Ray cluster of its own, and the `ray` extra.
    "ray_train": "ray_train_test.py",
}


def run_example(name, backend, *flags, env=None):
    """Runs `examples/<name>.py` as a program of its own (`prewarmed.run`)
    with `KERAS_BACKEND=backend`; returns the completed process."""
    return prewarmed.run(
        [os.path.join(testing.EXAMPLES_DIR, f"{name}.py"), *flags],
        env={**(env or {}), "KERAS_BACKEND": backend},
        timeout=300,
    )


def output_of(name, backend, *flags):
    """Runs the example (see `run_example`); returns its stdout."""
    result = run_example(name, backend, *flags)
    if result.returncode != 0:
        raise AssertionError(
            f"{name} failed on {backend}:\n{result.stderr[-3000:]}"
        )
    return result.stdout


def printed(output, label):
    """Returns the number printed after `label: ` in `output`."""
    match = re.search(rf"(?m)^{re.escape(label)}: (-?[0-9.e+-]+)", output)
    if match is None:
        raise AssertionError(f"{label!r} not printed:\n{output}")
    return float(match.group(1))


@functools.cache
def causal_lm_output(backend, *flags):
    """Runs `fine_tune_causal_lm` with small flags once per arguments."""
    return output_of(
        "fine_tune_causal_lm",
        backend,
        "--epochs=2",
        "--sequences=64",
        "--batch_size=16",
        *flags,
    )


def this_backend_output(name, *flags):
    """Runs the example under this session's backend; returns its stdout."""
    return output_of(name, testing.BACKEND, *flags)


def digits_train_size(validation_fraction=0.2):
    """The number of training images of examples/digits.py's split
    (scikit-learn rounds the held-out share up)."""
    total = len(datasets.load_digits().target)
    return total - math.ceil(validation_fraction * total)


def validation_accuracy(output):
    return printed(output, "validation accuracy")


def read(path):
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def is_program(path):
    """Whether an example file is a program (not a module they share)."""
    return 'if __name__ == "__main__":' in read(path)


def other_tests_naming(name):
    """The test files other than this one that name `examples/<name>.py`
    (as "<name>" or "<name>.py", quoted)."""
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    pattern = re.compile(rf"[\"']{re.escape(name)}(\.py)?[\"']")
    return [
        filename
        for filename in sorted(os.listdir(tests_dir))
        if filename.endswith(".py")
        and filename != os.path.basename(__file__)
        and pattern.search(read(os.path.join(tests_dir, filename)))
    ]


class TestExamples:
    @BACKENDS
    def test_quickstart_learns_digits(self, backend):
        """The quickstart prints a validation accuracy well above chance."""
        output = output_of("quickstart", backend, "--epochs=5")
        assert validation_accuracy(output) > 0.6, output

    @BACKENDS
    def test_activity_regularization_logs_each_component(self, backend):
        """Every loss component and its val_ twin is printed, the components
        add up to the loss, and the model learns."""
        output = output_of("activity_regularization", backend, "--epochs=3")
        components = ("data_loss", "regularization_loss", "l2_penalty")
        for name in (*components, "logit_penalty"):
            assert re.search(f"(?m)^{name}: [0-9.]+$", output), name
            assert re.search(f"(?m)^val_{name}: [0-9.]+$", output), name
        total = sum(
            printed(output, name) for name in (*components, "logit_penalty")
        )
        np.testing.assert_allclose(total, printed(output, "loss"), rtol=1e-3)
        assert validation_accuracy(output) > 0.5, output

    @BACKENDS
    def test_mnist_mlp_writes_logs_png_and_csv(self, backend):
        """TensorBoard events, a PNG and a CSV with one column per layer,
        and an accuracy above chance after one epoch on digits."""
        output_dir = tempfile.mkdtemp()
        output = output_of(
            "mnist_mlp", backend, "--epochs=2", f"--output_dir={output_dir}"
        )
        assert validation_accuracy(output) > 0.3, output
        with open(os.path.join(output_dir, "gradient_norms.png"), "rb") as f:
            assert f.read(4) == b"\x89PNG"
        with open(os.path.join(output_dir, "gradient_norms.csv")) as f:
            header = f.readline().strip()
        assert header == "step,dense_1,dense_2,predictions"
        events = os.listdir(os.path.join(output_dir, "logs", "train"))
        assert any(name.startswith("events.out") for name in events), events

    @BACKENDS
    def test_inspect_gradients_writes_what_it_inspected(self, backend):
        """TensorBoard tags per layer (read back with TensorBoard's own
        reader), a PNG that decodes, a CSV of finite positive norms, every
        statistic printed, and an accuracy above chance."""
        from tensorboard.backend.event_processing import event_accumulator

        output_dir = tempfile.mkdtemp()
        output = output_of(
            "inspect_gradients",
            backend,
            "--epochs=2",
            f"--output_dir={output_dir}",
        )
        assert validation_accuracy(output) > 0.3, output
        for statistic in ("norm", "max_abs", "zero_fraction", "update_ratio"):
            assert re.search(rf"(?m)^  {statistic}: dense_1=", output)
        layers = ["dense_1", "dense_2", "predictions"]
        image = pyplot.imread(os.path.join(output_dir, "gradient_norms.png"))
        assert min(image.shape[:2]) > 100
        with open(os.path.join(output_dir, "gradient_norms.csv")) as f:
            rows = list(csv.DictReader(f))
        assert list(rows[0]) == ["step", *layers]
        norms = [float(row[layer]) for row in rows for layer in layers]
        assert all(0 < n < math.inf for n in norms), norms
        accumulator = event_accumulator.EventAccumulator(
            os.path.join(output_dir, "logs", "train"),
            size_guidance={event_accumulator.TENSORS: 0},
        )
        accumulator.Reload()
        tags = set(accumulator.Tags()["tensors"])
        for layer in layers:
            assert f"grad_norm_step/{layer}" in tags, tags
            assert f"gradients/{layer}" in tags, tags
        assert "epoch_loss" in tags, tags  # Keras' TensorBoard, same dir

    @BACKENDS
    def test_linear_regression_recovers_the_coefficients(self, backend):
        """The fitted W and b are within 0.02 of the generating ones."""
        output = output_of("linear_regression", backend, "--epochs=10")
        assert printed(output, "max coefficient error") < 0.02, output

    @BACKENDS
    def test_gradient_centralization_centres_every_update(self, backend):
        """With centralization the weight change of each unit sums to ~0
        over its inputs (the definition); without, it does not. Both
        variants learn."""
        output = output_of("gradient_centralization", backend, "--epochs=2")
        assert printed(output, "centralized validation accuracy") > 0.5
        assert printed(output, "plain validation accuracy") > 0.5
        centralized = printed(
            output, "centralized largest per-unit sum of weight changes"
        )
        plain = printed(output, "plain largest per-unit sum of weight changes")
        assert centralized < 1e-4, output
        assert plain > 1e-2, output

    @BACKENDS
    def test_wgan_gp_logs_the_library_penalty_and_writes_a_png(self, backend):
        """The critic's gradient penalty (from the library) and both losses
        are logged, finite, and the grid is a real PNG."""
        output_png = os.path.join(tempfile.mkdtemp(), "grid.png")
        output = output_of(
            "wgan_gp",
            backend,
            "--epochs=2",
            "--critic_steps=2",
            f"--output={output_png}",
        )
        for name in (
            "d_loss",
            "g_loss",
            "critic_input_gradient_penalty",
            "critic_grad_norm",
            "generator_grad_norm",
        ):
            assert math.isfinite(printed(output, name)), name
        assert printed(output, "critic_input_gradient_penalty") > 0
        with open(output_png, "rb") as f:
            assert f.read(4) == b"\x89PNG"

    @BACKENDS
    def test_gan_logs_both_networks_and_writes_a_png(self, backend):
        """Both losses and each network's gradient norms are logged, the
        discriminator's clipped norm respects its bound, and the grid of
        generated digits is a real PNG."""
        output_png = os.path.join(tempfile.mkdtemp(), "grid.png")
        output = output_of(
            "gan",
            backend,
            "--epochs=2",
            "--discriminator_clipnorm=0.5",
            f"--output={output_png}",
        )
        for name in ("d_loss", "g_loss", "generator_grad_norm"):
            assert math.isfinite(printed(output, name)), name
        assert printed(output, "discriminator_grad_norm") > 0.5, output
        assert printed(output, "discriminator_grad_norm_clipped") <= 0.5 + 1e-4
        assert printed(output, "discriminator_clip_rate") > 0.0, output
        assert "generator gradient norms by layer: g_dense_1=" in output
        with open(output_png, "rb") as handle:
            assert handle.read(8) == b"\x89PNG\r\n\x1a\n"

    @BACKENDS
    def test_mnist_without_network_fails_with_a_clear_message(self, backend):
        """--dataset=mnist either trains (network there) or exits with a
        message naming --dataset=digits; never a bare traceback."""
        home = tempfile.mkdtemp()  # no cached copy of MNIST
        result = run_example(
            "mnist_mlp",
            backend,
            "--dataset=mnist",
            "--epochs=1",
            f"--output_dir={home}",
            env={"KERAS_HOME": home},
        )
        if result.returncode == 0:
            assert validation_accuracy(result.stdout) > 0.5, result.stdout
            return
        assert result.returncode == 1, result.stderr[-2000:]
        assert "--dataset=digits" in result.stderr
        assert "Traceback" not in result.stderr

    @BACKENDS
    def test_private_training_learns_and_spends_dp_accountings_epsilon(
        self, backend
    ):
        """DP-SGD on Poisson-sampled batches learns digits well above chance
        in three epochs, and the epsilon printed is dp-accounting's
        Poisson-sampled epsilon of the steps it ran."""
        import dp_accounting
        from dp_accounting import rdp

        output = output_of("private_training", backend, "--epochs=3")
        examples = int(printed(output, "training examples"))
        steps = int(printed(output, "steps"))
        assert steps == 3 * -(-examples // 64), output
        ledger = rdp.RdpAccountant()
        ledger.compose(
            dp_accounting.PoissonSampledDpEvent(
                64 / examples, dp_accounting.GaussianDpEvent(1.1)
            ),
            steps,
        )
        np.testing.assert_allclose(
            printed(output, "epsilon"), ledger.get_epsilon(1e-5), rtol=1e-5
        )
        assert validation_accuracy(output) > 0.5, output

    @BACKENDS
    def test_audit_private_run_passes_every_check(self, backend):
        """The privacy guide's run audited by 400 canaries for 2 epochs:
        every check passes, the noise measured within 5% of the claimed,
        the canaries' contribution within 0.25 clip bound of 1, and the
        audited run learns as the plain one does (above chance)."""
        output = output_of(
            "audit_private_run", backend, "--epochs=2", "--num_canaries=400"
        )
        assert "audit: every check passed" in output, output
        assert output.count(": passed") == 5, output
        noise = re.search(r"noise\s+([0-9.]+) \+-", output)
        sensitivity = re.search(r"sensitivity\s+([0-9.]+) \+-", output)
        assert abs(float(noise.group(1)) - 1.0) < 0.05, output
        assert abs(float(sensitivity.group(1)) - 1.0) < 0.25, output
        plain, audited = re.search(
            r"accuracy without / with: ([0-9.]+) / ([0-9.]+)", output
        ).groups()
        assert min(float(plain), float(audited)) > 0.5, output

    @BACKENDS
    def test_private_training_reaches_a_target_epsilon_on_shuffled_batches(
        self, backend
    ):
        """--target_epsilon with --sampling=shuffle: the epsilon printed is
        at most the target and within 1% of it, dp-accounting's epsilon of
        one Gaussian mechanism per epoch at the printed noise."""
        import dp_accounting
        from dp_accounting import rdp

        output = output_of(
            "private_training",
            backend,
            "--epochs=3",
            "--sampling=shuffle",
            "--target_epsilon=20",
        )
        noise = printed(output, "noise multiplier")
        ledger = rdp.RdpAccountant()
        ledger.compose(dp_accounting.GaussianDpEvent(noise), 3)
        epsilon = printed(output, "epsilon")
        np.testing.assert_allclose(epsilon, ledger.get_epsilon(1e-5), rtol=1e-5)
        assert 0.99 * 20 <= epsilon <= 20, output

    @BACKENDS
    def test_private_lora_trains_only_adapters_within_the_target_epsilon(
        self, backend
    ):
        """Only the LoRA adapters train; the epsilon printed is
        dp-accounting's Poisson-sampled epsilon of the steps run at the
        printed noise, at most the target and within 3% of it; the
        fine-tuned model is well above chance."""
        import dp_accounting
        from dp_accounting import rdp

        output = output_of(
            "private_lora",
            backend,
            "--public_epochs=10",
            "--epochs=2",
            "--target_epsilon=3",
            "--delta=1e-4",
            "--batch_size=64",
        )
        trainable = re.search(r"(?m)^trainable variables: (.*)$", output)
        names = trainable.group(1).split(", ")
        assert names and all("lora_kernel" in name for name in names), output
        examples = int(printed(output, "private examples"))
        steps = int(printed(output, "steps"))
        assert steps == 2 * -(-examples // 64), output
        ledger = rdp.RdpAccountant()
        ledger.compose(
            dp_accounting.PoissonSampledDpEvent(
                64 / examples,
                dp_accounting.GaussianDpEvent(
                    printed(output, "noise multiplier")
                ),
            ),
            steps,
        )
        epsilon = printed(output, "epsilon")
        np.testing.assert_allclose(epsilon, ledger.get_epsilon(1e-4), rtol=1e-4)
        assert 0.97 * 3 <= epsilon <= 3, output
        assert validation_accuracy(output) > 0.6, output

    @BACKENDS
    def test_fine_tune_causal_lm_logs_a_norm_per_decoder_block(self, backend):
        """LoRA fine-tuning of the tiny Gemma: the loss falls, no step is
        skipped, the logs hold one gradient norm per decoder block (only
        the blocks train under LoRA), and the prompt leads the generation."""
        testing.import_keras_hub()
        output = causal_lm_output(backend)
        blocks = [f"gemma_backbone/decoder_block_{i}" for i in range(2)]
        logged = re.findall(r"(?m)^grad_norm/(\S+): ", output)
        assert sorted(logged) == blocks, output
        losses = [
            float(v) for v in re.findall(r"epoch \d+: loss=(\S+),", output)
        ]
        assert len(losses) == 2 and losses[1] < losses[0], output
        assert printed(output, "skipped_steps") == 0, output
        assert printed(output, "skipped_spikes") == 0, output
        # --global_clipnorm=0.05 bites, and bounds every clipped norm.
        assert printed(output, "clip_rate") > 0, output
        assert printed(output, "grad_norm_clipped") <= 0.05 * (1 + 1e-5)
        prompt = re.search(r"(?m)^prompt: (\[.*\])$", output).group(1)
        tokens = re.search(r"(?m)^generated: \[(.*)\]$", output).group(1)
        assert tokens.startswith(prompt[1:-1]), output

    @pytest.mark.jax
    def test_fine_tune_causal_lm_model_parallel_equals_one_device(self):
        """With --model_parallel (8 forced host devices, a 2x4 mesh laid out
        by GemmaBackbone.get_layout_map) the query kernels are split over
        the mesh, and the losses and norms equal one device's."""
        testing.import_keras_hub()
        output = causal_lm_output("jax", "--model_parallel")
        assert printed(output, "devices") == 8, output
        layout = re.search(r"(?m)^layout of \S+query/kernel: (.*)$", output)
        # Gemma's layout map: (model, batch, None), as JAX prints it.
        assert layout and "'model', 'batch'" in layout.group(1), output
        reference = causal_lm_output("jax")
        labels = ("loss", "grad_norm", "grad_norm_clipped")
        for label in labels:
            np.testing.assert_allclose(
                printed(output, label), printed(reference, label), rtol=1e-5
            )
        for block in range(2):
            label = f"grad_norm/gemma_backbone/decoder_block_{block}"
            np.testing.assert_allclose(
                printed(output, label), printed(reference, label), rtol=1e-5
            )

    def test_every_example_program_is_run(self):
        """Each program in examples/ is run by a test of this class (named
        after it), or by another test file that names it; those that need
        one backend by nature are in `TESTED_ELSEWHERE`."""
        tested_here = {
            name[len("test_") :]
            for cls in (TestExamples, *_BACKEND_EXAMPLE_TESTS)
            for name in dir(cls)
            if name.startswith("test_")
        }
        for filename in sorted(os.listdir(testing.EXAMPLES_DIR)):
            name, extension = os.path.splitext(filename)
            path = os.path.join(testing.EXAMPLES_DIR, filename)
            if extension != ".py" or not is_program(path):
                continue
            if name in TESTED_ELSEWHERE:
                assert TESTED_ELSEWHERE[name] in other_tests_naming(name), name
                continue
            here = any(test.startswith(name + "_") for test in tested_here)
            assert here or other_tests_naming(name), (
                f"examples/{filename} is not run by any test"
            )


# Examples run under this session's backend only (one test class each).
class FineTuningExampleTest(testing.TestCase):
    def test_fine_tuning_each_group_trains_at_its_own_rate(self):
        """Each group trains at its own rate; the model learns."""
        epochs, batch_size = 5, 32
        output = this_backend_output(
            "fine_tuning",
            "--pretrain_epochs=5",
            f"--epochs={epochs}",
            f"--batch_size={batch_size}",
        )
        self.assertAllClose(printed(output, "backbone learning rate"), 1e-5)
        self.assertAllClose(printed(output, "head learning rate"), 1e-3)
        updates = epochs * math.ceil(digits_train_size() / batch_size)
        self.assertEqual(printed(output, "backbone updates"), updates)
        self.assertEqual(printed(output, "head updates"), updates)
        backbone = printed(output, "backbone relative weight change")
        head = printed(output, "head relative weight change")
        self.assertGreater(backbone, 0.0)
        self.assertLess(backbone, 0.05 * head)
        self.assertGreater(
            printed(output, "pretraining validation accuracy (digits 0-4)"),
            0.8,
        )
        self.assertGreater(printed(output, "validation accuracy"), 0.4)


@pytest.mark.slow
class MultiTaskPCGradExampleTest(testing.TestCase):
    def test_multi_task_pcgrad_both_methods_learn_every_head(self):
        """PCGrad and the sum learn every head above chance."""
        output = this_backend_output("multi_task_pcgrad", "--epochs=3")
        chance = {"digit": 0.1, "parity": 0.5, "large": 0.5}
        for method in ("pcgrad", "sum"):
            for head, floor in chance.items():
                accuracy = printed(
                    output, f"{method} {head} validation accuracy"
                )
                self.assertGreater(accuracy, floor + 0.2, (method, head))
            pairs = printed(output, f"{method} conflicting task pairs per step")
            self.assertBetween(pairs, 0.0, 3.0)
        match = re.search(
            r"(?m)^pcgrad task order at the last step: \[(.*)\]$", output
        )
        self.assertIsNotNone(match, output)
        order = sorted(int(i) for i in match.group(1).split(","))
        self.assertEqual(order, [0, 1, 2])


@pytest.mark.slow
class ScheduledOptionsExampleTest(testing.TestCase):
    def test_scheduled_options_logged_values_follow_the_schedules(self):
        """The printed values follow the schedules' formulas."""
        epochs, batch_size, warmup, decay = 4, 64, 2, 3
        output = this_backend_output(
            "scheduled_options",
            f"--epochs={epochs}",
            f"--batch_size={batch_size}",
            f"--warmup_epochs={warmup}",
            f"--l2_decay_epochs={decay}",
            "--l2_start=1e-3",
            "--l2_end=1e-5",
            "--clipnorm_start=0.05",
            "--clipnorm_end=1.0",
        )
        steps = math.ceil(digits_train_size() / batch_size)
        self.assertEqual(printed(output, "steps per epoch"), steps)

        def l2_weight(step):
            fraction = min(step, decay * steps) / (decay * steps)
            return (1e-3 - 1e-5) * (1.0 - fraction) + 1e-5

        def clipnorm(step):
            return 0.05 + (1.0 - 0.05) * min(step / (warmup * steps), 1.0)

        lines = re.findall(r"(?m)^epoch (\d+): (.*)$", output)
        self.assertEqual([int(e) for e, _ in lines], [1, 2, 3, 4])
        for epoch, fields in lines:
            logged = {
                key: float(value)
                for key, value in re.findall(r"(\S+)=(\S+)", fields)
            }
            last_step = int(epoch) * steps - 1
            self.assertAllClose(
                logged["l2_weight"], l2_weight(last_step), rtol=1e-4
            )
            self.assertAllClose(
                logged["global_clipnorm"], clipnorm(last_step), rtol=1e-4
            )
            self.assertLessEqual(
                logged["grad_norm_clipped"], logged["global_clipnorm"] + 1e-3
            )
            self.assertLessEqual(
                logged["grad_norm_clipped"], logged["grad_norm"] + 1e-3
            )
            self.assertBetween(logged["clip_rate"], 0.0, 1.0)
        self.assertGreater(printed(output, "validation accuracy"), 0.5)


_BACKEND_EXAMPLE_TESTS = (
    FineTuningExampleTest,
    MultiTaskPCGradExampleTest,
    ScheduledOptionsExampleTest,
)
