"""`minimize`, the gradient pipeline as a building block: a two-network GAN,
and knowledge distillation with the student's predictions handed back.

The GAN is `examples/gan.py`'s, on two tiny networks: each step updates the
discriminator, then the generator (on fresh noise, against the updated
discriminator), each through `minimize(loss_function, optimizer=...)`.
The oracle is those alternating SGD steps written by hand: the same noise
(Keras' seeded `keras.random.normal`), hand-written cross-entropies, and
gradients of `stateless_call` from the backend's own autodiff
(`testing.value_and_gradients`).
"""

import contextlib

import keras
import numpy as np
import pytest
from absl.testing import parameterized
from keras import ops

import custom_fit
from tests import testing

GAN = testing.import_example("gan").GAN

NOISE, FEATURES = 3, 4
SEED = 7  # of the GAN's noise


class Generator(custom_fit.GradientInspectionMixin, keras.Model):
    pass


class Discriminator(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    pass


def dense(units, seed, name, activation=None):
    return keras.layers.Dense(
        units,
        activation=activation,
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
        bias_initializer=keras.initializers.RandomNormal(0.0, 0.1, seed=seed),
        name=name,
    )


def networks(
    generator_class=keras.Model,
    discriminator_class=keras.Model,
    **discriminator_kwargs,
):
    """The generator and the discriminator, with fixed initial weights."""
    noise = keras.Input((NOISE,))
    hidden = dense(8, 1, "g_hidden", "relu")(noise)
    generator = generator_class(
        noise, dense(FEATURES, 2, "g_out")(hidden), name="generator"
    )
    sample = keras.Input((FEATURES,))
    hidden = dense(8, 3, "d_hidden", "relu")(sample)
    discriminator = discriminator_class(
        sample,
        dense(1, 4, "d_out")(hidden),
        name="discriminator",
        **discriminator_kwargs,
    )
    return generator, discriminator


def real_data(samples=32):
    rng = np.random.RandomState(0)
    return (rng.randn(samples, FEATURES) + 2.0).astype("float32")


def train_gan(
    strategy=None,
    batch_size=32,
    epochs=1,
    real=None,
    gan_class=GAN,
    **discriminator_kwargs,
):
    """Trains the example's GAN on `real` (in order); returns it and its
    History dict."""
    real = real_data() if real is None else real
    scope = contextlib.nullcontext() if strategy is None else strategy.scope()
    with scope:
        generator, discriminator = networks(
            Generator, Discriminator, **discriminator_kwargs
        )
        gan = gan_class(generator, discriminator, NOISE, seed=SEED)
        gan.compile(keras.optimizers.SGD(0.1), keras.optimizers.SGD(0.1))
    history = gan.fit(
        real, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0
    )
    return gan, history.history


# The oracle.


def run(network, weights, x):
    """The network's output with `weights` as its trainable values."""
    outputs, _ = network.stateless_call(weights, [], x, training=True)
    return outputs


def cross_entropy(logits, label):
    """Mean binary cross-entropy of logits against a constant label."""
    if label == 1:
        return ops.mean(ops.softplus(-logits))
    return ops.mean(ops.softplus(logits))


def alternating_sgd(real, batch_size, steps, clipnorm=None, lr=0.1):
    """The example's steps by hand, from the initial weights of `networks`.

    Per batch, in order: noise from a `SeedGenerator(SEED)`; SGD on the
    discriminator's loss (its gradient clipped to `clipnorm` in global norm
    with NumPy, or not); new noise; SGD on the generator's loss against the
    updated discriminator.

    Returns:
        A dict: the final `generator` and `discriminator` weights, and per
        step the losses and the gradients (`d_loss`, `d_grads`, `g_loss`,
        `g_grads`, lists).
    """
    generator, discriminator = networks()
    g_weights = [testing.to_numpy(v) for v in generator.trainable_variables]
    d_weights = [testing.to_numpy(v) for v in discriminator.trainable_variables]
    seeds = keras.random.SeedGenerator(SEED)
    record = {"d_loss": [], "d_grads": [], "g_loss": [], "g_grads": []}
    for step in range(steps):
        batch = real[step * batch_size : (step + 1) * batch_size]
        noise = testing.to_numpy(
            keras.random.normal((len(batch), NOISE), seed=seeds)
        )
        fake = testing.to_numpy(run(generator, g_weights, noise))
        d_loss, d_grads = testing.value_and_gradients(
            lambda w, batch=batch, fake=fake: (
                cross_entropy(run(discriminator, w, batch), 1)
                + cross_entropy(run(discriminator, w, fake), 0)
            ),
            d_weights,
        )
        update = d_grads
        if clipnorm is not None:
            update = testing.numpy_clip_by_global_norm(d_grads, clipnorm)
        d_weights = testing.weights_after_one_sgd_step(d_weights, update, lr)
        noise = testing.to_numpy(
            keras.random.normal((len(batch), NOISE), seed=seeds)
        )
        g_loss, g_grads = testing.value_and_gradients(
            lambda w, noise=noise, d_weights=d_weights: cross_entropy(
                run(discriminator, d_weights, run(generator, w, noise)), 1
            ),
            g_weights,
        )
        g_weights = testing.weights_after_one_sgd_step(g_weights, g_grads, lr)
        for key, value in zip(
            ("d_loss", "d_grads", "g_loss", "g_grads"),
            (d_loss, d_grads, g_loss, g_grads),
        ):
            record[key].append(value)
    record.update(generator=g_weights, discriminator=d_weights)
    return record


def global_norm(gradients):
    return np.sqrt(sum(np.sum(np.float64(g) ** 2) for g in gradients))


class NoiseFromData(GAN):
    """The example's GAN with noise computed from each real sample.

    A replica then gets the noise of its share of the batch, as one device
    gets that of the whole batch (the seeded noise is the same on every
    replica), so a mirrored run can equal a single-device one.
    """

    def train_step(self, data):
        real, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        self.discriminator_step(real, ops.sin(3.0 * real[:, :NOISE]))
        self.generator_step(ops.cos(5.0 * real[:, :NOISE]))
        return self.get_metrics_result()


class GANTest(testing.TestCase):
    def test_steps_equal_alternating_sgd_by_hand(self):
        """Two epochs of two steps: weights and logged losses equal the
        hand-written alternating updates."""
        gan, history = train_gan(batch_size=16, epochs=2)
        expected = alternating_sgd(
            np.concatenate([real_data()] * 2), 16, steps=4
        )
        self.assertAllClose(
            gan.discriminator.get_weights(),
            expected["discriminator"],
            atol=1e-5,
        )
        self.assertAllClose(
            gan.generator.get_weights(), expected["generator"], atol=1e-5
        )
        for key in ("d_loss", "g_loss"):
            per_epoch = np.reshape(expected[key], (2, 2)).mean(axis=1)
            self.assertAllClose(history[key], per_epoch, rtol=1e-5, msg=key)

    def test_discriminator_clipping_changes_only_its_updates(self):
        """One step: the clipped discriminator's update equals SGD with the
        NumPy-clipped gradient; the generator's is SGD with its unclipped
        gradient (larger than the bound), against the updated
        discriminator."""
        real = real_data()
        unclipped = alternating_sgd(real, 32, steps=1)
        max_norm = global_norm(unclipped["d_grads"][0]) / 8  # the clip bites
        expected = alternating_sgd(real, 32, steps=1, clipnorm=max_norm)
        self.assertGreater(global_norm(expected["g_grads"][0]), 2 * max_norm)

        clipped, _ = train_gan(global_clipnorm=max_norm)
        self.assertAllClose(
            clipped.discriminator.get_weights(), expected["discriminator"]
        )
        self.assertAllClose(
            clipped.generator.get_weights(), expected["generator"]
        )
        keras.backend.clear_session()
        plain, _ = train_gan()
        self.assertAllClose(
            plain.discriminator.get_weights(), unclipped["discriminator"]
        )
        self.assertAllClose(
            plain.generator.get_weights(), unclipped["generator"]
        )

    def test_each_network_logs_its_own_inspection(self):
        """Each network's grad_norm is logged under its name and equals the
        norm of its gradient; per-layer norms are readable on each."""
        expected = alternating_sgd(real_data(), 32, steps=1, clipnorm=0.1)
        d_grads, g_grads = expected["d_grads"][0], expected["g_grads"][0]
        self.assertGreater(global_norm(d_grads), 0.5)  # the clip bites
        gan, history = train_gan(global_clipnorm=0.1)
        self.assertEqual(
            sorted(history),
            [
                "d_loss",
                "discriminator_clip_rate",
                "discriminator_grad_norm",
                "discriminator_grad_norm_clipped",
                "g_loss",
                "generator_grad_norm",
            ],
        )
        for key in ("discriminator_grad_norm",):
            self.assertAllClose(
                history[key][0], global_norm(d_grads), rtol=1e-5, msg=key
            )
        self.assertAllClose(
            history["discriminator_grad_norm_clipped"][0], 0.1, rtol=1e-5
        )
        self.assertEqual(history["discriminator_clip_rate"], [1.0])
        for key in ("generator_grad_norm",):
            self.assertAllClose(
                history[key][0], global_norm(g_grads), rtol=1e-5, msg=key
            )
        self.assertEqual(
            sorted(gan.discriminator.gradient_norms), ["d_hidden", "d_out"]
        )
        self.assertAllClose(
            gan.generator.gradient_norms["g_out"],
            global_norm(g_grads[2:]),
            rtol=1e-5,
        )

    @pytest.mark.tensorflow
    def test_under_mirrored_strategy_equals_single_device(self):
        """Two replicas, clipped discriminator, four steps: the same
        weights and logs as one device (noise from the data, see
        `NoiseFromData`). TensorFlow only: tf.distribute."""
        kwargs = dict(
            batch_size=16,
            epochs=2,
            gan_class=NoiseFromData,
            global_clipnorm=0.1,
        )
        single, single_history = train_gan(**kwargs)
        keras.backend.clear_session()
        mirrored, mirrored_history = train_gan(
            testing.mirrored_strategy(), **kwargs
        )
        self.assertWeightsClose(single, mirrored, atol=2e-6)
        for key in single_history:
            self.assertAllClose(
                mirrored_history[key], single_history[key], rtol=1e-5
            )

    def test_network_skip_guard_inside_the_gan(self):
        """NaN real images poison only the discriminator's gradient: it
        skips (weights unchanged, counted under its name), the generator
        trains, and the network's consecutive-skip limit stops fit."""
        real = np.full_like(real_data(), np.nan)
        gan, history = train_gan(real=real, batch_size=16, skip_nonfinite=True)
        generator, discriminator = networks()
        self.assertAllClose(
            gan.discriminator.get_weights(), discriminator.get_weights()
        )
        self.assertEqual(history["discriminator_skipped_steps"], [2.0])
        moved = testing.max_difference(
            gan.generator.get_weights(), generator.get_weights()
        )
        self.assertGreater(moved, 1e-4)
        keras.backend.clear_session()
        with self.assertRaisesRegex(RuntimeError, "'discriminator'"):
            train_gan(
                real=real,
                batch_size=8,
                skip_nonfinite=True,
                max_consecutive_skipped_steps=2,
            )


def mean_output(generator):
    """A loss function: the mean output of `generator` on a ones batch."""
    return lambda: ops.mean(generator(ops.ones((2, NOISE))))


class MinimizeTest(testing.TestCase):
    def test_without_an_optimizer_raises(self):
        """`minimize` on a network that has no optimizer names the fix."""
        generator, _ = networks(Generator)
        with self.assertRaisesRegex(ValueError, r"optimizer=None"):
            generator.minimize(mean_output(generator))

    def test_eager_call_equals_sgd(self):
        """Called eagerly outside fit, with a loss function, it updates
        like SGD."""
        generator, _ = networks(Generator)
        weights = generator.get_weights()
        _, gradients = testing.value_and_gradients(
            lambda w: ops.mean(run(generator, w, ops.ones((2, NOISE)))),
            weights,
        )
        optimizer = keras.optimizers.SGD(0.5)
        self.assertIsNone(
            generator.minimize(mean_output(generator), optimizer=optimizer)
        )
        self.assertAllClose(
            generator.get_weights(),
            testing.weights_after_one_sgd_step(weights, gradients, 0.5),
        )

    @pytest.mark.tensorflow
    def test_eager_tape_call_equals_sgd(self):
        """The TensorFlow form, a loss recorded on a tape, updates like SGD
        too. TensorFlow only: tf.GradientTape."""
        import tensorflow as tf

        generator, _ = networks(Generator)
        weights = generator.get_weights()
        optimizer = keras.optimizers.SGD(0.5)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(generator(tf.ones((2, NOISE))))
        gradients = tape.gradient(loss, generator.trainable_variables)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(generator(tf.ones((2, NOISE))))
        self.assertIsNone(generator.minimize(loss, tape, optimizer=optimizer))
        self.assertAllClose(
            generator.get_weights(),
            testing.weights_after_one_sgd_step(
                weights, [g.numpy() for g in gradients], 0.5
            ),
        )

    @pytest.mark.tensorflow
    def test_loss_function_equals_loss_and_tape(self):
        """minimize(loss_fn) updates exactly like minimize(loss, tape).
        TensorFlow only: the tape form."""
        import tensorflow as tf

        results = []
        for form in ("function", "tape"):
            keras.utils.set_random_seed(0)
            generator, _ = networks(Generator)
            optimizer = keras.optimizers.SGD(0.5)
            loss_fn = mean_output(generator)
            if form == "function":
                generator.minimize(loss_fn, optimizer=optimizer)
            else:
                with tf.GradientTape() as tape:
                    loss = loss_fn()
                generator.minimize(loss, tape, optimizer=optimizer)
            results.append(generator.get_weights())
        self.assertAllClose(results[0], results[1], atol=0)

    def test_loss_tensor_without_tape_raises(self):
        """A loss tensor without its tape is refused."""
        generator, _ = networks(Generator)
        with self.assertRaisesRegex(ValueError, "tape=None"):
            generator.minimize(
                ops.convert_to_tensor(1.0), optimizer=keras.optimizers.SGD()
            )

    @pytest.mark.tensorflow
    def test_loss_function_with_a_tape_raises(self):
        """A loss function with a tape is refused. TensorFlow only: a
        tf.GradientTape."""
        import tensorflow as tf

        generator, _ = networks(Generator)
        with tf.GradientTape() as tape:
            pass
        with self.assertRaisesRegex(ValueError, "Leave `tape` out"):
            generator.minimize(
                lambda: 0.0, tape, optimizer=keras.optimizers.SGD()
            )

    @pytest.mark.jax
    def test_tape_form_refused_on_jax(self):
        """On JAX, a loss with a tape is refused, pointing to the loss
        function form."""
        generator, _ = networks(Generator)
        loss = mean_output(generator)()
        tape = contextlib.nullcontext()  # stands for a tf.GradientTape
        with self.assertRaisesRegex(ValueError, r"minimize\(loss_function"):
            generator.minimize(loss, tape, optimizer=keras.optimizers.SGD())


# Knowledge distillation (keras-io's `Distiller`): a frozen teacher, a
# student trained with `minimize`, whose predictions come back as `aux` and
# feed the compiled metrics.

CLASSES, TEMPERATURE, ALPHA = 3, 2.0, 0.3


class Student(custom_fit.TrainStepMixin, keras.Model):
    pass


class Distiller(custom_fit.TrainStepMixin, keras.Model):
    def __init__(self, student, teacher, **kwargs):
        super().__init__(**kwargs)
        self.student = student
        self.teacher = teacher
        self.student_loss_fn = keras.losses.SparseCategoricalCrossentropy(
            from_logits=True
        )
        self.distillation_loss_fn = keras.losses.KLDivergence()

    def call(self, x):
        return self.student(x)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        teacher_logits = self.teacher(x, training=False)

        def loss_function():
            y_pred = self.student(x, training=True)
            student_loss = self.student_loss_fn(y, y_pred, sample_weight)
            distillation_loss = self.distillation_loss_fn(
                ops.softmax(teacher_logits / TEMPERATURE, axis=1),
                ops.softmax(y_pred / TEMPERATURE, axis=1),
            )
            loss = ALPHA * student_loss
            loss += (1 - ALPHA) * TEMPERATURE**2 * distillation_loss
            return loss, y_pred

        _, y_pred = self.student.minimize(
            loss_function, optimizer=self.optimizer, has_aux=True
        )
        return self.compute_metrics(x, y, y_pred, None)


class ClosureDistiller(Distiller):
    """Takes the student's predictions out through a closure instead."""

    def train_step(self, data):
        x, y, _ = keras.utils.unpack_x_y_sample_weight(data)
        seen = {}

        def loss_function():
            seen["y_pred"] = self.student(x, training=True)
            return self.student_loss_fn(y, seen["y_pred"])

        self.student.minimize(loss_function, optimizer=self.optimizer)
        return self.compute_metrics(x, y, seen["y_pred"], None)


def distillation_networks(**student_options):
    x = keras.Input((FEATURES,))
    teacher = keras.Model(x, dense(CLASSES, 11, "teacher")(x))
    teacher.trainable = False
    student = Student(x, dense(CLASSES, 12, "student")(x), **student_options)
    return student, teacher


def distillation_data(samples=32):
    rng = np.random.RandomState(3)
    x = rng.randn(samples, FEATURES).astype("float32")
    return x, rng.randint(0, CLASSES, samples)


def softmax(logits):
    shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
    return shifted / shifted.sum(axis=1, keepdims=True)


def distillation_by_hand(
    x, y, sample_weight, batch_size, epochs, lr, accumulation=1
):
    """The distiller's SGD steps in NumPy (float64), from the initial
    weights: per batch, the gradient of the loss with respect to the
    student's logits z of each example is ALPHA * w * (softmax(z) - onehot)
    + (1 - ALPHA) * T * (softmax(z / T) - softmax(teacher / T)), averaged
    over the batch; a non-finite gradient skips the update; with
    accumulation, the mean gradient of `accumulation` batches is applied
    after the last. Returns the final kernel and bias and the accuracy of
    each epoch (of the predictions before each update)."""
    student, teacher = distillation_networks()
    kernel, bias = (np.float64(w) for w in student.get_weights())
    t_kernel, t_bias = (np.float64(w) for w in teacher.get_weights())
    accuracies = []
    pending = []
    for _ in range(epochs):
        correct = 0
        for start in range(0, len(x), batch_size):
            xb = np.float64(x[start : start + batch_size])
            yb = y[start : start + batch_size]
            wb = np.float64(sample_weight[start : start + batch_size])
            logits = xb @ kernel + bias
            correct += np.sum(np.argmax(logits, axis=1) == yb)
            soft_teacher = softmax((xb @ t_kernel + t_bias) / TEMPERATURE)
            onehot = np.eye(CLASSES)[yb]
            grad_logits = ALPHA * wb[:, None] * (softmax(logits) - onehot)
            grad_logits += (
                (1 - ALPHA)
                * TEMPERATURE
                * (softmax(logits / TEMPERATURE) - soft_teacher)
            )
            grad_logits /= len(xb)
            pending.append((xb.T @ grad_logits, grad_logits.sum(axis=0)))
            if len(pending) < accumulation:
                continue
            grad_kernel = sum(g[0] for g in pending) / accumulation
            grad_bias = sum(g[1] for g in pending) / accumulation
            pending = []
            if np.all(np.isfinite(grad_kernel)):
                kernel = kernel - lr * grad_kernel
                bias = bias - lr * grad_bias
        accuracies.append(correct / len(x))
    return [kernel, bias], accuracies


DISTILLATION_CASES = testing.runnable(
    (
        ("eager", dict(run_eagerly=True), {}, None),
        ("compiled", testing.compiled(), {}, None),
        ("steps_per_execution", testing.looped(2), {}, None),
        (
            "accumulation",
            testing.compiled(),
            dict(gradient_accumulation_steps=2),
            None,
        ),
        ("skipping", testing.compiled(), dict(skip_nonfinite=True), 12),
    )
)


class KnowledgeDistillationTest(testing.TestCase):
    @parameterized.named_parameters(*DISTILLATION_CASES)
    def test_student_and_metrics_equal_a_hand_written_step(
        self, compile_options, student_options, nan_row
    ):
        """Two epochs of 4 batches: the student's weights equal the
        hand-written SGD steps (1e-6) and the compiled accuracy, computed
        from the predictions `minimize` hands back (`has_aux=True`), equals
        the hand-written one of each epoch. With accumulation the update
        comes every second batch; with `skip_nonfinite`, a NaN sample
        weight in the second batch skips its update (its predictions still
        count in the metrics)."""
        x, y = distillation_data()
        sample_weight = np.ones(len(x), "float32")
        if nan_row is not None:
            sample_weight[nan_row] = np.nan
        student, teacher = distillation_networks(**student_options)
        distiller = Distiller(student, teacher)
        distiller.compile(
            optimizer=keras.optimizers.SGD(0.5),
            metrics=["sparse_categorical_accuracy"],
            **compile_options,
        )
        history = distiller.fit(
            x,
            y,
            sample_weight=sample_weight,
            batch_size=8,
            epochs=2,
            shuffle=False,
            verbose=0,
        )
        weights, accuracies = distillation_by_hand(
            x,
            y,
            sample_weight,
            batch_size=8,
            epochs=2,
            lr=0.5,
            accumulation=student_options.get("gradient_accumulation_steps", 1),
        )
        self.assertAllClose(student.get_weights(), weights, atol=1e-6)
        self.assertAllClose(
            history.history["sparse_categorical_accuracy"],
            accuracies,
            atol=1e-6,
        )

    def test_a_pair_without_has_aux_names_it(self):
        """A loss function returning `(loss, aux)` without `has_aux=True`
        is refused with the call that fixes it, the model unchanged."""
        student, _ = distillation_networks()
        weights = student.get_weights()
        x, _ = distillation_data(4)

        def loss_function():
            y_pred = student(x)
            return ops.mean(y_pred), y_pred

        with self.assertRaisesRegex(ValueError, r"has_aux=True"):
            student.minimize(loss_function, optimizer=keras.optimizers.SGD())
        self.assertAllClose(student.get_weights(), weights, atol=0)

    def test_has_aux_takes_a_pair(self):
        """`has_aux=True` with a function returning the loss alone, or a
        value of `has_aux` that is no bool, is refused."""
        student, _ = distillation_networks()
        x, _ = distillation_data(4)
        with self.assertRaisesRegex(ValueError, r"Received: a result of type"):
            student.minimize(
                lambda: ops.mean(student(x)),
                optimizer=keras.optimizers.SGD(),
                has_aux=True,
            )
        with self.assertRaisesRegex(ValueError, r"has_aux='yes'"):
            student.minimize(
                lambda: ops.mean(student(x)),
                optimizer=keras.optimizers.SGD(),
                has_aux="yes",
            )

    def test_eager_call_returns_the_aux_it_computed(self):
        """Called outside `fit`, `minimize(..., has_aux=True)` returns
        `(None, aux)`: aux, a nested structure, holds the forward pass'
        values (before the update) and a Python value as given."""
        student, _ = distillation_networks()
        x, _ = distillation_data(4)
        expected = testing.to_numpy(student(x))

        def loss_function():
            y_pred = student(x)
            return ops.mean(y_pred), {"y_pred": y_pred, "step": 3}

        applied, aux = student.minimize(
            loss_function, optimizer=keras.optimizers.SGD(0.5), has_aux=True
        )
        self.assertIsNone(applied)
        self.assertEqual(aux["step"], 3)
        self.assertAllClose(testing.to_numpy(aux["y_pred"]), expected)
        moved = np.max(np.abs(testing.to_numpy(student(x)) - expected))
        self.assertGreater(moved, 1e-3)  # the update was applied

    @pytest.mark.tensorflow
    def test_has_aux_with_a_tape_is_refused(self):
        """The tape form has no loss function to return aux. TensorFlow
        only: a tf.GradientTape."""
        import tensorflow as tf

        student, _ = distillation_networks()
        x, _ = distillation_data(4)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(student(x))
        with self.assertRaisesRegex(ValueError, r"has_aux=True. takes a loss"):
            student.minimize(
                loss, tape, optimizer=keras.optimizers.SGD(), has_aux=True
            )

    @pytest.mark.jax
    def test_a_value_escaping_through_a_closure_names_has_aux(self):
        """On JAX, predictions taken out of the loss function through a
        closure fail with a message that names `has_aux=True`. JAX only:
        the loss function runs inside `jax.value_and_grad`."""
        import jax

        x, y = distillation_data()
        distiller = ClosureDistiller(*distillation_networks())
        distiller.compile(
            optimizer="sgd", metrics=["sparse_categorical_accuracy"]
        )
        with self.assertRaisesRegex(
            jax.errors.UnexpectedTracerError, r"has_aux=True"
        ):
            distiller.fit(x, y, batch_size=8, verbose=0)
