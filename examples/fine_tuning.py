"""Fine-tuning: a pretrained backbone at 1e-5, a new head at 1e-3.

A backbone (Dense 64 - Dense 64) is first "pretrained" on part of the
task: the digits 0-4 of scikit-learn's bundled 8x8 digits, with a
five-class head. Then a new ten-class head is put on top of it and the
whole model is fine-tuned on all the digits with
`custom_fit.MultiOptimizer`: Adam at `--backbone_learning_rate` (1e-5) for
the pretrained layers, Adam at `--head_learning_rate` (1e-3) for the new
head. Each group has its own optimizer, slots and learning rate; scaling
the backbone's gradients instead would not do, since Adam divides a
constant factor out.

The global gradient norm is clipped first, over the whole model
(`custom_fit.GradientClippingMixin`), and then each group's optimizer
applies its share. The program prints the validation accuracy after each
phase, each group's learning rate, and how far each group's weights moved
while fine-tuning (the backbone barely does).

    python examples/fine_tuning.py --pretrain_epochs=10 --epochs=20
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import digits  # noqa: E402  (examples/digits.py)
import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import custom_fit  # noqa: E402

_PRETRAIN_EPOCHS = flags.DEFINE_integer(
    "pretrain_epochs", 10, "Epochs of pretraining on the digits 0-4."
)
_EPOCHS = flags.DEFINE_integer("epochs", 20, "Epochs of fine-tuning.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Batch size.")
_BACKBONE_LEARNING_RATE = flags.DEFINE_float(
    "backbone_learning_rate", 1e-5, "Adam step size of the backbone."
)
_HEAD_LEARNING_RATE = flags.DEFINE_float(
    "head_learning_rate", 1e-3, "Adam step size of the new head."
)
_GLOBAL_CLIPNORM = flags.DEFINE_float(
    "global_clipnorm", 1.0, "Bound on the whole model's gradient norm."
)
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")

PRETRAINED_CLASSES = 5  # the digits 0-4


class FineTuned(custom_fit.GradientClippingMixin, keras.Model):
    """A functional model whose true gradients are clipped globally."""


def build_backbone(features):
    """Returns the backbone: two ReLU layers, as one Sequential layer."""
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(64, activation="relu", name="dense_1"),
            keras.layers.Dense(64, activation="relu", name="dense_2"),
        ],
        name="backbone",
    )


def with_head(model_class, backbone, classes, head_name, **kwargs):
    """Returns `backbone` followed by a new Dense head of `classes` logits."""
    inputs = keras.Input(backbone.input_shape[1:], name="pixels")
    outputs = keras.layers.Dense(classes, name=head_name)(backbone(inputs))
    return model_class(inputs, outputs, **kwargs)


def pretrain(backbone, x, y, x_val, y_val):
    """Trains the backbone with a five-class head on the digits 0-4.

    Returns the validation accuracy on the held-out digits 0-4.
    """
    seen, seen_val = y < PRETRAINED_CLASSES, y_val < PRETRAINED_CLASSES
    model = with_head(keras.Model, backbone, PRETRAINED_CLASSES, "pretext")
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        x[seen],
        y[seen],
        batch_size=_BATCH_SIZE.value,
        epochs=_PRETRAIN_EPOCHS.value,
        validation_data=(x_val[seen_val], y_val[seen_val]),
        verbose=0,
    )
    return history.history["val_accuracy"][-1]


def relative_change(before, after):
    """Returns ||after - before|| / ||before|| over lists of arrays."""
    difference = sum(np.sum((a - b) ** 2) for a, b in zip(after, before))
    size = sum(np.sum(b**2) for b in before)
    return float(np.sqrt(difference / size))


def main(argv):
    """Pretrains the backbone, fine-tunes with two optimizers, prints."""
    del argv
    keras.utils.set_random_seed(_SEED.value)
    (x_train, y_train), (x_val, y_val) = digits.load_digits(_SEED.value)
    backbone = build_backbone(x_train.shape[1])
    accuracy = pretrain(backbone, x_train, y_train, x_val, y_val)
    print(f"pretraining validation accuracy (digits 0-4): {accuracy:.4f}")

    model = with_head(
        FineTuned,
        backbone,
        10,
        "head",
        global_clipnorm=_GLOBAL_CLIPNORM.value,
    )
    optimizer = custom_fit.MultiOptimizer(
        [
            (keras.optimizers.Adam(_BACKBONE_LEARNING_RATE.value), backbone),
            (keras.optimizers.Adam(_HEAD_LEARNING_RATE.value), "head"),
        ]
    )
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    groups = {"backbone": backbone, "head": model.get_layer("head")}
    before = {
        name: [keras.ops.convert_to_numpy(w) for w in layer.weights]
        for name, layer in groups.items()
    }
    history = model.fit(
        x_train,
        y_train,
        batch_size=_BATCH_SIZE.value,
        epochs=_EPOCHS.value,
        validation_data=(x_val, y_val),
        verbose=0,
    )
    for (name, layer), group in zip(groups.items(), optimizer.optimizers):
        rate = float(keras.ops.convert_to_numpy(group.learning_rate))
        after = [keras.ops.convert_to_numpy(w) for w in layer.weights]
        change = relative_change(before[name], after)
        print(f"{name} learning rate: {rate:.0e}")
        updates = int(keras.ops.convert_to_numpy(group.iterations))
        print(f"{name} updates: {updates}")
        print(f"{name} relative weight change: {change:.3g}")
    accuracy = history.history["val_accuracy"][-1]
    print(f"validation accuracy: {accuracy:.4f}")


if __name__ == "__main__":
    app.run(main)
