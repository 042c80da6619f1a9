"""Per-layer gradient figures in the logs (layer_norms_in_logs,
grad_norm_step) and nested layer groups (layer_depth), against the norms
of the oracle's gradients at each step."""

import csv
import os
import tempfile

import keras
import numpy as np
from absl.testing import parameterized
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.util import tensor_util

import custom_fit
from tests import testing

BATCH = 16
STEPS_PER_EPOCH = 4  # 64 samples
RATE = 0.1
MLP_LAYERS = {"hidden": [0, 1], "output": [2, 3]}  # trainable variables


class Inspected(custom_fit.GradientInspectionMixin, keras.Model):
    pass


class Clipped(custom_fit.GradientClippingMixin, keras.Model):
    pass


class Plain(custom_fit.TrainStepMixin, keras.Model):
    pass


def compiled(model, **compile_kwargs):
    model.compile(
        optimizer=keras.optimizers.SGD(RATE),
        loss=testing.sparse_crossentropy(),
        **compile_kwargs,
    )
    return model


def fit(model, x, y, epochs=2, callbacks=()):
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    ).history


def norm(arrays):
    return float(
        np.sqrt(sum(np.sum(np.asarray(a, np.float64) ** 2) for a in arrays))
    )


def oracle_steps(model, x, y, steps, layers, clip=None):
    """Trains `model` with SGD by hand; returns each step's figures.

    Each step takes the oracle's gradients of the batch, records the norm
    of every layer's gradients (`layers` maps a name to variable indices)
    and the global norm, optionally transforms them with `clip`, and
    applies `w - RATE * g`.
    """
    loss = testing.sparse_crossentropy()
    variables = model.trainable_variables
    figures = []
    for t in range(steps):
        start = (t % STEPS_PER_EPOCH) * BATCH
        grads = testing.tape_gradients(
            model, x[start : start + BATCH], y[start : start + BATCH], loss
        )
        figures.append(
            {
                "global": norm(grads),
                **{
                    name: norm([grads[i] for i in indices])
                    for name, indices in layers.items()
                },
            }
        )
        if clip is not None:
            grads = clip(grads)
        weights = [testing.to_numpy(v) for v in variables]
        for variable, new in zip(
            variables, testing.weights_after_one_sgd_step(weights, grads, RATE)
        ):
            variable.assign(np.asarray(new, "float32"))
    return figures


def first_layer_clipped(grads, bound):
    """The first layer's kernel and bias clipped to `bound` together."""
    scale = bound / max(norm(grads[:2]), bound)
    return [g * scale for g in grads[:2]] + list(grads[2:])


def epoch_means(figures, key, epochs=2):
    return [
        np.mean(
            [
                f[key]
                for f in figures[
                    e * STEPS_PER_EPOCH : (e + 1) * STEPS_PER_EPOCH
                ]
            ]
        )
        for e in range(epochs)
    ]


def encoder_dense(units, seed, name):
    """A ReLU Dense layer of `units` named `name`, its kernel and bias
    initializers seeded by `seed`."""
    return keras.layers.Dense(
        units,
        activation="relu",
        kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
        bias_initializer=keras.initializers.RandomNormal(0.0, 0.1, seed=seed),
        name=name,
    )


def nested_model(model_class=keras.Model, **kwargs):
    """A `keras.Sequential` encoder (d1, d2) used as a layer, then `head`."""
    encoder = keras.Sequential(
        [
            keras.Input((4,)),
            encoder_dense(8, seed=1, name="d1"),
            encoder_dense(6, seed=2, name="d2"),
        ],
        name="encoder",
    )
    inputs = keras.Input((4,), name="features")
    outputs = keras.layers.Dense(
        3,
        kernel_initializer=keras.initializers.GlorotUniform(seed=3),
        name="head",
    )(encoder(inputs))
    return model_class(inputs, outputs, **kwargs)


def layer_clipped(bound, **kwargs):
    """`nested_model` of `Clipped`, with `layer_clipnorm=bound` and
    `layer_depth=2` (the encoder's layers clipped apart) and `kwargs`."""
    return nested_model(Clipped, layer_clipnorm=bound, layer_depth=2, **kwargs)


NESTED_LAYERS = {
    "encoder/d1": [0, 1],
    "encoder/d2": [2, 3],
    "head": [4, 5],
}


class BatchLogs(keras.callbacks.Callback):
    """Keeps a copy of the logs of every batch."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs))


class LayerNormsInLogsTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_csv_logger_rows_hold_epoch_mean_of_layer_norms(self, mode):
        """CSVLogger rows hold the epoch means of the oracle layer norms."""
        x, y = testing.classification_data()
        path = os.path.join(tempfile.mkdtemp(), "log.csv")
        model = testing.mlp(Inspected, layer_norms_in_logs=True)
        compiled(model, **mode)
        fit(model, x, y, callbacks=[keras.callbacks.CSVLogger(path)])
        with open(path) as f:
            rows = list(csv.DictReader(f))
        self.assertLen(rows, 2)
        for column in ("grad_norm/hidden", "grad_norm/output", "grad_norm"):
            self.assertIn(column, rows[0])

        figures = oracle_steps(testing.mlp(), x, y, 8, MLP_LAYERS)
        for layer in ("hidden", "output"):
            self.assertAllClose(
                [float(row[f"grad_norm/{layer}"]) for row in rows],
                epoch_means(figures, layer),
                rtol=1e-5,
                msg=layer,
            )
        self.assertAllClose(
            [float(row["grad_norm"]) for row in rows],
            epoch_means(figures, "global"),
            rtol=1e-5,
        )
        # A step's own figure is no epoch figure: the rows leave it out.
        self.assertNotIn("grad_norm_step", rows[0])

    def test_off_by_default(self):
        """Without layer_norms_in_logs no grad_norm/<layer> is logged; the
        step's own grad_norm_step reaches batch logs, not History."""
        x, y = testing.classification_data()
        seen = BatchLogs()
        model = compiled(testing.mlp(Inspected))
        history = fit(model, x, y, epochs=1, callbacks=[seen])
        self.assertFalse([k for k in history if k.startswith("grad_norm/")])
        self.assertNotIn("grad_norm_step", history)
        self.assertIn("grad_norm_step", seen.logs[-1])
        self.assertIn("grad_norm_step", model.metrics_names)

    def test_tensorboard_writes_layer_norms(self):
        """Keras' TensorBoard writes grad_norm/<layer> epoch means."""
        x, y = testing.classification_data()
        log_dir = tempfile.mkdtemp()
        model = compiled(testing.mlp(Inspected, layer_norms_in_logs=True))
        fit(model, x, y, callbacks=[keras.callbacks.TensorBoard(log_dir)])
        accumulator = event_accumulator.EventAccumulator(
            os.path.join(log_dir, "train"),
            size_guidance={event_accumulator.TENSORS: 0},
        )
        accumulator.Reload()
        tags = set(accumulator.Tags()["tensors"])
        figures = oracle_steps(testing.mlp(), x, y, 8, MLP_LAYERS)
        for layer in ("hidden", "output"):
            tag = f"epoch_grad_norm/{layer}"
            self.assertIn(tag, tags)
            events = sorted(accumulator.Tensors(tag), key=lambda e: e.step)
            self.assertEqual([e.step for e in events], [0, 1])
            written = [
                float(tensor_util.make_ndarray(e.tensor_proto)) for e in events
            ]
            self.assertAllClose(
                written, epoch_means(figures, layer), rtol=1e-5, msg=layer
            )

    @parameterized.named_parameters(
        *testing.runnable(
            [
                ("eager", dict(run_eagerly=True)),
                ("graph_fn", dict(run_eagerly=False, jit_compile=False)),
                ("jit", dict(run_eagerly=False, jit_compile=True)),
            ]
        )
    )
    def test_batch_callback_sees_each_steps_own_norm(self, mode):
        """Batches see grad_norm_step per step and running means."""
        x, y = testing.classification_data()
        model = compiled(
            testing.mlp(Inspected, layer_norms_in_logs=True), **mode
        )
        seen = BatchLogs()
        fit(model, x, y, callbacks=[seen])
        figures = oracle_steps(testing.mlp(), x, y, 8, MLP_LAYERS)
        self.assertLen(seen.logs, 8)
        for t, logs in enumerate(seen.logs):
            epoch_start = t - t % STEPS_PER_EPOCH
            so_far = figures[epoch_start : t + 1]
            self.assertAllClose(
                logs["grad_norm_step"], figures[t]["global"], rtol=1e-5
            )
            self.assertAllClose(
                logs["grad_norm"],
                np.mean([f["global"] for f in so_far]),
                rtol=1e-5,
            )
            self.assertAllClose(
                logs["grad_norm/hidden"],
                np.mean([f["hidden"] for f in so_far]),
                rtol=1e-5,
            )
        # The step's own norm and the running mean differ: the figure is
        # not the mean under another name.
        self.assertGreater(
            abs(seen.logs[-1]["grad_norm_step"] - seen.logs[-1]["grad_norm"]),
            1e-4,
        )


class LayerDepthTest(testing.TestCase):
    def test_depth_two_names_the_layers_inside_a_nested_model(self):
        """layer_depth=2 names the layers inside the encoder."""
        x, y = testing.classification_data()
        model = nested_model(Inspected, layer_depth=2, layer_norms_in_logs=True)
        history = fit(compiled(model), x, y)
        figures = oracle_steps(nested_model(), x, y, 8, NESTED_LAYERS)
        self.assertEqual(set(model.gradient_norms), set(NESTED_LAYERS))
        for layer in NESTED_LAYERS:
            self.assertAllClose(
                model.gradient_norms[layer],
                figures[-1][layer],
                rtol=1e-5,
                msg=layer,
            )
            self.assertAllClose(
                history[f"grad_norm/{layer}"],
                epoch_means(figures, layer),
                rtol=1e-5,
                msg=layer,
            )

    def test_a_renamed_layer_names_its_group_anew(self):
        """The group names follow a rename made after they were first
        asked for, at depth 1 and inside the nested model at depth 2
        (the model's own `layers` are the oracle)."""
        model = nested_model(Inspected, layer_depth=2)
        variables = model.trainable_variables
        self.assertEqual(
            model.layer_names_of(variables),
            ["encoder/d1"] * 2 + ["encoder/d2"] * 2 + ["head"] * 2,
        )
        model.get_layer("head").name = "top"
        model.get_layer("encoder").get_layer("d1").name = "first"
        self.assertEqual(
            model.layer_names_of(variables),
            ["encoder/first"] * 2 + ["encoder/d2"] * 2 + ["top"] * 2,
        )

    def test_depth_one_keeps_the_nested_model_whole(self):
        """With layer_depth=1 the encoder is one group."""
        x, y = testing.classification_data(samples=16)
        model = nested_model(Inspected, layer_depth=1)
        fit(compiled(model), x, y, epochs=1)
        self.assertEqual(set(model.gradient_norms), {"encoder", "head"})

    @parameterized.named_parameters(
        *testing.runnable(
            [
                ("graph_fn", dict(jit_compile=False)),
                ("jit", dict(jit_compile=True)),
            ]
        )
    )
    def test_layer_clipnorm_clips_each_nested_layer(self, mode):
        """layer_clipnorm with layer_depth=2 clips each nested layer."""
        x, y = testing.classification_data()
        bound = 0.1
        groups = [
            name for name, indices in NESTED_LAYERS.items() for _ in indices
        ]
        model = layer_clipped(bound)
        fit(compiled(model, **mode), x, y)

        def clip(grads):
            return testing.numpy_clip_by_group_norm(grads, groups, bound)

        oracle = nested_model()
        figures = oracle_steps(oracle, x, y, 8, NESTED_LAYERS, clip=clip)
        self.assertWeightsClose(model, oracle, atol=2e-6)
        # The bound bit on every layer at the first step.
        for layer in NESTED_LAYERS:
            self.assertGreater(figures[0][layer], bound, layer)

        whole = ["encoder"] * 4 + ["head"] * 2
        shallow = nested_model()
        oracle_steps(
            shallow,
            x,
            y,
            8,
            NESTED_LAYERS,
            clip=lambda g: testing.numpy_clip_by_group_norm(g, whole, bound),
        )
        self.assertGreater(
            testing.max_difference(model.get_weights(), shallow.get_weights()),
            1e-4,
        )

    def test_clip_layers_selects_a_nested_layer(self):
        """clip_layers=["encoder/d1"] clips only that nested layer."""
        x, y = testing.classification_data()
        bound = 0.1
        model = layer_clipped(bound, clip_layers=["encoder/d1"])
        fit(compiled(model), x, y)

        oracle = nested_model()
        oracle_steps(
            oracle,
            x,
            y,
            8,
            NESTED_LAYERS,
            clip=lambda g: first_layer_clipped(g, bound),
        )
        self.assertWeightsClose(model, oracle, atol=2e-6)

    def test_clip_layers_may_name_a_frozen_nested_layer(self):
        """A frozen layer named in clip_layers is accepted, the rest clipped.

        Fine-tuning freezes part of an encoder; the selection names the
        layer still, and the layers that train are clipped as named.
        """
        x, y = testing.classification_data()
        bound = 0.1
        model = layer_clipped(bound, clip_layers=["encoder/d1", "encoder/d2"])
        model.get_layer("encoder").get_layer("d2").trainable = False
        fit(compiled(model), x, y)

        oracle = nested_model()
        oracle.get_layer("encoder").get_layer("d2").trainable = False
        oracle_steps(
            oracle,
            x,
            y,
            8,
            {"encoder/d1": [0, 1], "head": [2, 3]},
            clip=lambda g: first_layer_clipped(g, bound),
        )
        self.assertWeightsClose(model, oracle, atol=2e-6)

    def test_clip_layers_that_name_only_frozen_layers_are_refused(self):
        """Clipping only frozen layers would clip nothing: refused by name."""
        x, y = testing.classification_data()
        model = layer_clipped(0.1, clip_layers=["encoder"])
        model.get_layer("encoder").trainable = False
        compiled(model)
        before = model.get_weights()
        with self.assertRaisesRegex(
            ValueError,
            r"`clip_layers` selects no trainable variable.*"
            r"clip_layers=\['encoder'\]; the layers that train: \['head'\]",
        ):
            fit(model, x, y)
        self.assertEqual(testing.max_difference(model.get_weights(), before), 0)
        # Leaving out every layer that trains clips nothing either.
        leaves_out = layer_clipped(0.1, no_clip_layers=["encoder/d1", "head"])
        leaves_out.get_layer("encoder").get_layer("d2").trainable = False
        compiled(leaves_out)
        with self.assertRaisesRegex(
            ValueError, r"`no_clip_layers` leaves out every layer that trains"
        ):
            fit(leaves_out, x, y)
        # Known when the model is made, as a misspelled name is.
        frozen = nested_model()
        frozen.get_layer("head").trainable = False
        with self.assertRaisesRegex(ValueError, r"clip_layers=\['head'\]"):
            Clipped(
                frozen.inputs,
                frozen.outputs,
                clipnorm=1.0,
                clip_layers=["head"],
            )

    def test_layer_depth_without_inspection_or_layer_clipping_is_refused(
        self,
    ):
        """layer_depth without inspection or layer clipping is refused."""
        with self.assertRaisesRegex(ValueError, "layer_depth"):
            nested_model(Plain, layer_depth=2)
        with self.assertRaisesRegex(ValueError, "layer_depth"):
            nested_model(Clipped, layer_depth=2, global_clipnorm=1.0)
        self.assertEqual(nested_model(Inspected, layer_depth=2).layer_depth, 2)
        self.assertEqual(
            nested_model(
                Clipped, layer_depth=2, layer_clipnorm=1.0
            ).layer_depth,
            2,
        )

    @parameterized.named_parameters(("zero", 0), ("negative", -1))
    def test_invalid_layer_depth_is_refused(self, value):
        """layer_depth must be a positive integer."""
        with self.assertRaisesRegex(ValueError, "layer_depth"):
            nested_model(Inspected, layer_depth=value)


class ReportLastTest(testing.TestCase):
    @parameterized.named_parameters(
        *testing.runnable(
            [
                ("graph_fn", dict(jit_compile=False)),
                ("steps_per_execution", dict(steps_per_execution=4)),
            ]
        )
    )
    def test_report_metric_last_logs_the_last_step(self, mode):
        """reduction="last" logs the last step; "mean" the mean."""

        class Counting(custom_fit.TrainStepMixin, keras.Model):
            def train_step(self, data):
                step = keras.ops.cast(self.optimizer.iterations, "float32")
                self.report_metric("step_last", step, reduction="last")
                self.report_metric("step_mean", step)
                return super().train_step(data)

        x, y = testing.classification_data()
        history = fit(compiled(testing.mlp(Counting), **mode), x, y)
        self.assertAllClose(history["step_last"], [3.0, 7.0])
        self.assertAllClose(history["step_mean"], [1.5, 5.5])


class ProgressBarLogsTest(testing.TestCase):
    def bar(self, **options):
        """Fits with Keras' one-line-per-epoch bar; returns its last line
        and History's keys."""
        import contextlib
        import io

        x, y = testing.classification_data()
        model = compiled(testing.mlp(Inspected, **options))
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            history = model.fit(
                x,
                y,
                batch_size=BATCH,
                epochs=1,
                verbose=2,
                validation_split=0.25,
            ).history
        return printed.getvalue().strip().splitlines()[-1], sorted(history)

    def columns(self, line):
        return sorted(
            part.split(":")[0].strip() for part in line.split(" - ")[3:]
        )

    def test_default_bar_leaves_out_layer_columns(self):
        """By default the bar shows every log but grad_norm/<layer>, which
        History, CSVLogger and TensorBoard still get."""
        line, history = self.bar(layer_norms_in_logs=True)
        self.assertEqual(self.columns(line), ["grad_norm", "loss", "val_loss"])
        self.assertEqual(
            history,
            [
                "grad_norm",
                "grad_norm/hidden",
                "grad_norm/output",
                "loss",
                "val_loss",
            ],
        )

    @parameterized.named_parameters(
        (
            "patterns",
            ["loss", "grad_norm*"],
            [
                "grad_norm",
                "grad_norm/hidden",
                "grad_norm/output",
                "loss",
                "val_loss",
            ],
        ),
        ("loss_only", ["loss"], ["loss", "val_loss"]),
        (
            "all",
            "all",
            [
                "grad_norm",
                "grad_norm/hidden",
                "grad_norm/output",
                "loss",
                "val_loss",
            ],
        ),
    )
    def test_selection_chooses_the_columns(self, selection, shown):
        """progress_bar_logs picks the columns (a name brings its val_
        twin); History is unchanged."""
        line, history = self.bar(
            layer_norms_in_logs=True, progress_bar_logs=selection
        )
        self.assertEqual(self.columns(line), shown)
        self.assertLen(history, 5)

    def test_selection_matching_no_log_warns(self):
        """A name of the selection that matches no log is named, with the
        closest log."""
        with self.assertWarnsRegex(
            UserWarning, r"'los', which matches no log.*Did you mean 'loss'"
        ):
            self.bar(progress_bar_logs=["los", "grad_norm"])

    def test_bad_selection_is_refused(self):
        with self.assertRaisesRegex(
            ValueError, r"Received: progress_bar_logs='loss'"
        ):
            testing.mlp(Inspected, progress_bar_logs="loss")


class BothMixins(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    pass


class SubclassedWrapper(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    """A subclassed model around a model one already has. (Not a subclass
    of `BothMixins`: Keras makes a class functional in place once it is
    called with inputs and outputs, and its subclasses with it.)"""

    def __init__(self, base, **kwargs):
        super().__init__(**kwargs)
        self.base = base

    def call(self, x):
        return self.base(x)


def base_model(kind):
    """`nested_model`'s layers (the encoder d1, d2, then head), as a
    functional or a Sequential model named "base"."""
    nested = nested_model()
    if kind == "sequential":
        return keras.Sequential(
            [
                keras.Input((4,)),
                nested.get_layer("encoder"),
                nested.get_layer("head"),
            ],
            name="base",
        )
    return keras.Model(nested.inputs, nested.outputs, name="base")


def wrapped(kind, **options):
    """A custom_fit model with `options` around a base model."""
    if kind == "subclassed":
        return SubclassedWrapper(base_model("functional"), **options)
    if kind == "inputs_and_outputs":
        base = base_model("functional")
        return BothMixins(base.inputs, base.outputs, **options)
    inputs = keras.Input((4,))
    return BothMixins(inputs, base_model(kind)(inputs), **options)


class WrappedModelTest(testing.TestCase):
    @parameterized.named_parameters(
        ("functional", "functional", "base/"),
        ("sequential", "sequential", "base/"),
        ("subclassed", "subclassed", "base/"),
        ("inputs_and_outputs", "inputs_and_outputs", ""),
    )
    def test_a_wrapped_model_keeps_its_layers(self, kind, prefix):
        """A model one already has, wrapped as a functional, Sequential or
        subclassed model's layer or rebuilt from its inputs and outputs, is
        grouped by its own layers at any depth by default: per-layer norms
        (the model's and the logs'), and per-layer clipping, equal SGD by
        hand on the layers' gradients, each layer clipped on its own."""
        x, y = testing.classification_data()
        bound = 0.1
        model = wrapped(kind, layer_clipnorm=bound, layer_norms_in_logs=True)
        history = fit(compiled(model), x, y)
        layers = {prefix + name: v for name, v in NESTED_LAYERS.items()}
        groups = [name for name, indices in layers.items() for _ in indices]

        def clip(grads):
            return testing.numpy_clip_by_group_norm(grads, groups, bound)

        oracle = nested_model()
        figures = oracle_steps(oracle, x, y, 8, layers, clip=clip)
        self.assertEqual(set(model.gradient_norms), set(layers))
        for layer in layers:
            self.assertAllClose(
                model.gradient_norms[layer], figures[-1][layer], rtol=1e-5
            )
            self.assertAllClose(
                history[f"grad_norm/{layer}"],
                epoch_means(figures, layer),
                rtol=1e-5,
                msg=layer,
            )
            self.assertGreater(figures[0][layer], bound, layer)
        self.assertWeightsClose(model, oracle, atol=2e-6)

    def test_clip_layers_name_the_wrapped_model_or_a_layer_in_it(self):
        """`clip_layers=["base/head"]` clips that layer alone (SGD by hand
        with only its gradients clipped); `["base"]` is accepted (it
        selects every layer inside), a name it does not have is refused
        with the groups' names."""
        x, y = testing.classification_data()
        bound = 0.1
        model = wrapped(
            "functional", layer_clipnorm=bound, clip_layers=["base/head"]
        )
        fit(compiled(model), x, y)
        groups = ["rest"] * 4 + ["head"] * 2

        def clip(grads):
            clipped = testing.numpy_clip_by_group_norm(grads, groups, bound)
            return list(grads[:4]) + list(clipped[4:])

        oracle = nested_model()
        oracle_steps(oracle, x, y, 8, NESTED_LAYERS, clip=clip)
        self.assertWeightsClose(model, oracle, atol=2e-6)
        wrapped("functional", layer_clipnorm=bound, clip_layers=["base"])
        with self.assertRaisesRegex(
            ValueError, r"\['encoder'\].*'base/encoder/d1'"
        ):
            wrapped("functional", layer_clipnorm=bound, clip_layers=["encoder"])
