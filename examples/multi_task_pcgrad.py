"""Multi-task learning with PCGrad against the plain sum of the losses.

One shared trunk (Dense 64 - Dense 64) and three heads on scikit-learn's
bundled 8x8 digits: the digit (10 classes), its parity, and whether it is
greater than 4. The model is trained twice from the same initial weights:

- with `custom_fit.PCGradMixin`: each head's loss is differentiated on its
  own, and each task's gradient is projected onto the normal plane of the
  other tasks' gradients it conflicts with (Yu et al. 2020);
- with the plain sum of the three losses (`per_loss_gradients="outputs"`
  and the default `combine_gradients`, which is what Keras does).

Both count, at each step, how many pairs of tasks have conflicting
gradients (a negative dot product), through an override of the
`combine_gradients` hook that reports the count with `report_metric`.
The program prints each head's validation accuracy for both methods.

    python examples/multi_task_pcgrad.py --epochs=20
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import itertools  # noqa: E402

import digits  # noqa: E402  (examples/digits.py)
import keras  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from keras import ops  # noqa: E402

import custom_fit  # noqa: E402

_EPOCHS = flags.DEFINE_integer("epochs", 20, "Training epochs.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Batch size.")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-3, "Adam step size.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")

# Task name: number of classes.
TASKS = {"digit": 10, "parity": 2, "large": 2}


def targets(labels):
    """Returns the three tasks' labels for digit labels 0-9."""
    return {
        "digit": labels,
        "parity": labels % 2,
        "large": (labels > 4).astype("int32"),
    }


class ConflictCounter(custom_fit.TrainStepMixin):
    """Reports `conflicting_pairs`: task pairs whose gradients conflict."""

    def combine_gradients(self, gradients_by_loss, variables):
        """Counts the conflicting pairs, then combines as the base does."""
        flat = [
            ops.concatenate(
                [
                    ops.reshape(ops.zeros_like(v) if g is None else g, (-1,))
                    for g, v in zip(gradients, variables)
                ]
            )
            for gradients in gradients_by_loss.values()
        ]
        conflicts = [
            ops.cast(ops.sum(a * b) < 0, "float32")
            for a, b in itertools.combinations(flat, 2)
        ]
        self.report_metric("conflicting_pairs", sum(conflicts))
        return super().combine_gradients(gradients_by_loss, variables)


class PCGradNet(ConflictCounter, custom_fit.PCGradMixin, keras.Model):
    """Projects conflicting task gradients."""


class SumNet(ConflictCounter, keras.Model):
    """Sums the task gradients (Keras' own update)."""


def build(model_class, features, **kwargs):
    """Returns the shared trunk with one head (logits) per task."""
    inputs = keras.Input((features,), name="pixels")
    x = keras.layers.Dense(64, activation="relu", name="dense_1")(inputs)
    x = keras.layers.Dense(64, activation="relu", name="dense_2")(x)
    outputs = {
        name: keras.layers.Dense(classes, name=name)(x)
        for name, classes in TASKS.items()
    }
    return model_class(inputs, outputs, **kwargs)


def train(model, x_train, y_train, x_val, y_val):
    """Trains `model`; returns its validation figures."""
    model.compile(
        optimizer=keras.optimizers.Adam(_LEARNING_RATE.value),
        loss={
            name: keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            for name in TASKS
        },
        metrics={name: ["accuracy"] for name in TASKS},
    )
    history = model.fit(
        x_train,
        targets(y_train),
        batch_size=_BATCH_SIZE.value,
        epochs=_EPOCHS.value,
        verbose=0,
    )
    figures = model.evaluate(x_val, targets(y_val), verbose=0, return_dict=True)
    figures["conflicting_pairs"] = history.history["conflicting_pairs"][-1]
    return figures


def main(argv):
    """Trains with PCGrad and with the plain sum; prints each head."""
    del argv
    (x_train, y_train), (x_val, y_val) = digits.load_digits(_SEED.value)
    features = x_train.shape[1]
    models = {}
    keras.utils.set_random_seed(_SEED.value)
    models["pcgrad"] = build(PCGradNet, features, pcgrad_seed=_SEED.value)
    keras.utils.set_random_seed(_SEED.value)  # the same initial weights
    models["sum"] = build(SumNet, features, per_loss_gradients="outputs")
    for method, model in models.items():
        figures = train(model, x_train, y_train, x_val, y_val)
        for name in TASKS:
            accuracy = figures[f"{name}_accuracy"]
            print(f"{method} {name} validation accuracy: {accuracy:.4f}")
        pairs = figures["conflicting_pairs"]
        print(f"{method} conflicting task pairs per step: {pairs:.3f}")
    print(f"pcgrad task order at the last step: {models['pcgrad'].task_order}")


if __name__ == "__main__":
    app.run(main)
