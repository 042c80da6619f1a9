"""Every mixin, and the full stack, with `skip_nonfinite` and accumulation.

The oracle of each case is the same model without `skip_nonfinite`,
trained on the data without the micro-batches of the skipped update: a
NaN in one micro-batch must skip its whole update and leave no trace
(weights, optimizer slots, the figures inspection logs).
"""

import os
import tempfile

import keras
import numpy as np
import pytest
from absl.testing import parameterized

import custom_fit
from tests import testing

BATCH = 8
STEPS = 2  # gradient_accumulation_steps
BAD_BATCH = 2  # its update (batches 2 and 3) is skipped


class Clipped(custom_fit.GradientClippingMixin, keras.Model):
    pass


class Inspected(custom_fit.GradientInspectionMixin, keras.Model):
    pass


class Regularized(custom_fit.RegularizationMixin, keras.Model):
    pass


class Sharp(custom_fit.SharpnessAwareMixin, keras.Model):
    pass


class TwoTasks(custom_fit.PCGradMixin, keras.Model):
    pass


class Stacked(
    custom_fit.SharpnessAwareMixin,
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    custom_fit.RegularizationMixin,
    keras.Model,
):
    pass


STACK_OPTIONS = dict(sam_rho=0.05, global_clipnorm=0.5, l2=1e-2)
# The stack with the guard and gradient accumulation.
GUARDED_STACK = dict(
    skip_nonfinite=True, gradient_accumulation_steps=STEPS, **STACK_OPTIONS
)

# name, model class, options
CASES = (
    ("clipping", Clipped, dict(global_clipnorm=0.5)),
    ("inspection", Inspected, {}),
    ("regularization", Regularized, dict(l2=1e-2)),
    ("sharpness", Sharp, dict(sam_rho=0.05)),
    ("pcgrad", TwoTasks, {}),
    ("stack", Stacked, STACK_OPTIONS),
)


def data(batches=6):
    """Returns `(x, y, x_clean, y_clean)`: one NaN in batch `BAD_BATCH`,
    and the data without the two batches of its update."""
    x, y = testing.classification_data(samples=BATCH * batches)
    x[BAD_BATCH * BATCH + 3, 0] = np.nan
    keep = np.ones(len(x), bool)
    keep[BAD_BATCH * BATCH : (BAD_BATCH + STEPS) * BATCH] = False
    return x, y, x[keep], y[keep]


def build(model_class, **options):
    """Returns the model: the tiny MLP, or two heads for PCGrad."""
    if model_class is not TwoTasks:
        return testing.mlp(model_class, **options)
    inputs = keras.Input((4,))
    shared = keras.layers.Dense(
        8,
        activation="relu",
        kernel_initializer=keras.initializers.GlorotUniform(seed=1),
    )(inputs)
    heads = {
        name: keras.layers.Dense(
            3,
            name=name,
            kernel_initializer=keras.initializers.GlorotUniform(seed=i),
        )(shared)
        for i, name in enumerate(("a", "b"), start=2)
    }
    return model_class(inputs, heads, **options)


def compiled(model, **compile_kwargs):
    loss = testing.sparse_crossentropy()
    if isinstance(model, TwoTasks):
        loss = {"a": testing.sparse_crossentropy(), "b": loss}
    model.compile(
        optimizer=keras.optimizers.Adam(0.05), loss=loss, **compile_kwargs
    )
    return model


def targets(model, y):
    if isinstance(model, TwoTasks):
        return {"a": y, "b": (y + 1) % 3}
    return y


def train(model, x, y, **compile_kwargs):
    compiled(model, **compile_kwargs)
    return model.fit(
        x, targets(model, y), batch_size=BATCH, shuffle=False, verbose=0
    ).history


def slots(model):
    return [testing.to_numpy(v) for v in model.optimizer.variables]


class GuardedAccumulationTest(testing.TestCase):
    @parameterized.named_parameters(
        (f"{name}_{mode_name}", model_class, options, mode)
        for name, model_class, options in CASES
        for mode_name, mode in testing.EXECUTION_MODES
    )
    def test_nan_micro_batch_skips_its_update(self, model_class, options, mode):
        """A NaN micro-batch skips its update and leaves weights, slots and
        inspected figures as training without that update's batches."""
        x, y, x_clean, y_clean = data()
        model = build(
            model_class,
            skip_nonfinite=True,
            gradient_accumulation_steps=STEPS,
            **options,
        )
        history = train(model, x, y, **mode)
        oracle = build(
            model_class, gradient_accumulation_steps=STEPS, **options
        )
        expected = train(oracle, x_clean, y_clean)
        self.assertAllClose(model.get_weights(), oracle.get_weights())
        self.assertAllClose(slots(model), slots(oracle))
        self.assertEqual(history["skipped_steps"], [1.0])
        for key in ("grad_norm", "grad_norm_clipped", "clip_rate"):
            if key in expected:
                self.assertAllClose(history[key], expected[key], msg=key)

    def test_stack_under_mixed_precision(self):
        """The stack trains under mixed_float16 (loss scaling) with the
        guard and accumulation, and the skipped update leaves no trace."""
        keras.mixed_precision.set_global_policy("mixed_float16")
        x, y, x_clean, y_clean = data()
        options = dict(gradient_accumulation_steps=STEPS, **STACK_OPTIONS)
        model = build(Stacked, skip_nonfinite=True, **options)
        history = train(model, x, y)
        oracle = build(Stacked, **options)
        train(oracle, x_clean, y_clean)
        self.assertAllClose(
            model.get_weights(), oracle.get_weights(), atol=1e-3
        )
        self.assertEqual(history["skipped_steps"], [1.0])

    def test_stack_on_two_devices(self):
        """The stack on two devices (MirroredStrategy, DataParallel)
        equals one device."""
        if testing.BACKEND not in ("tensorflow", "jax"):
            pytest.skip("no multi-device training on this backend")
        x, y, _, _ = data()
        single = build(Stacked, **GUARDED_STACK)
        train(single, x, y)
        with testing.two_devices():
            model = build(Stacked, **GUARDED_STACK)
            history = train(model, x, y)
        self.assertAllClose(
            model.get_weights(), single.get_weights(), atol=1e-5
        )
        self.assertEqual(history["skipped_steps"], [1.0])

    def test_stack_survives_saving(self):
        """A saved and loaded stacked model goes on training as the
        original does."""
        x, y, _, _ = data()
        model = build(Stacked, **GUARDED_STACK)
        train(model, x, y)
        path = os.path.join(tempfile.mkdtemp(), "stacked.keras")
        model.save(path)
        loaded = keras.models.load_model(
            path, custom_objects={"Stacked": Stacked}
        )
        self.assertEqual(loaded.get_config()["sam_rho"], 0.05)
        for each in (model, loaded):
            each.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        self.assertAllClose(loaded.get_weights(), model.get_weights())
