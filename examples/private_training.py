"""Differentially private training (DP-SGD) of the shared MLP on digits.

Trains the multi-layer perceptron of examples/mlp.py (Dense 64 -
Dense 64 - 10 logits) on scikit-learn's bundled 8x8 digits with
`custom_fit.DifferentialPrivacyMixin`: every microbatch's true gradient
(one example each by default) is clipped to `--l2_norm_clip` in global
norm, the clipped gradients are summed, Gaussian noise of standard
deviation `noise_multiplier * --l2_norm_clip` is added, and the sum is
divided by the expected batch size (or the number of microbatches).
`custom_fit.callbacks.PrivacyBudget` logs the epsilon spent at `--delta`
after each epoch (and stops at `--max_epsilon`, if given). Prints the
validation accuracy, the private steps run and the epsilon spent.

With `--sampling=poisson` (the default) the batches come from
`custom_fit.sampling.PoissonSampler`, each example in each batch with
probability batch_size / examples, as the accountant assumes. With
`--sampling=shuffle` they are `fit`'s shuffled batches (the training set
cut to a whole number of them, which `--num_microbatches` must divide),
accounted with one Gaussian mechanism per epoch. `--target_epsilon`
calibrates the noise to spend that epsilon over `--epochs` instead of
taking `--noise_multiplier`.

    python examples/private_training.py --epochs=30 --target_epsilon=3
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import digits  # noqa: E402  (examples/digits.py)
import keras  # noqa: E402
import mlp  # noqa: E402  (examples/mlp.py)
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import custom_fit  # noqa: E402
from custom_fit import callbacks  # noqa: E402

_L2_NORM_CLIP = flags.DEFINE_float(
    "l2_norm_clip", 1.0, "Bound of each microbatch's gradient norm."
)
_NOISE_MULTIPLIER = flags.DEFINE_float(
    "noise_multiplier", 1.1, "Noise standard deviation / l2_norm_clip."
)
_TARGET_EPSILON = flags.DEFINE_float(
    "target_epsilon",
    None,
    "Calibrate the noise to spend this epsilon over --epochs (overrides "
    "--noise_multiplier).",
)
_SAMPLING = flags.DEFINE_enum(
    "sampling",
    "poisson",
    ["poisson", "shuffle"],
    "Poisson-sampled batches, or fit's shuffled batches.",
)
_NUM_MICROBATCHES = flags.DEFINE_integer(
    "num_microbatches",
    None,
    "Microbatches per batch (a divisor of batch_size; --sampling=shuffle "
    "only); default: one per example.",
)
_EPOCHS = flags.DEFINE_integer("epochs", 30, "Training epochs.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Batch size.")
_DELTA = flags.DEFINE_float(
    "delta", 1e-5, "Target delta, below 1 / (number of training examples)."
)
_MAX_EPSILON = flags.DEFINE_float(
    "max_epsilon", None, "Stop training once epsilon exceeds this."
)
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate", 0.05, "SGD step size (momentum 0.9)."
)
_SEED = flags.DEFINE_integer("seed", 0, "Random seed (weights).")
_PRIVATE_SEED = flags.DEFINE_integer(
    "private_seed",
    None,
    "Seed of the noise and the sampler. Default: secret, drawn from the "
    "system; a seed makes them reproducible by whoever knows it.",
)


class PrivateMLP(custom_fit.DifferentialPrivacyMixin, keras.Model):
    """A functional model trained with DP-SGD."""


def main(argv):
    """Trains the MLP privately; prints validation accuracy and epsilon."""
    del argv
    keras.utils.set_random_seed(_SEED.value)
    (x_train, y_train), (x_val, y_val) = digits.load_digits(_SEED.value)
    batch_size = _BATCH_SIZE.value
    poisson = _SAMPLING.value == "poisson"
    if poisson:
        data = dict(
            x=custom_fit.sampling.PoissonSampler(
                x_train, y_train, batch_size, seed=_PRIVATE_SEED.value
            )
        )
    else:
        kept = len(x_train) // batch_size * batch_size
        x_train, y_train = x_train[:kept], y_train[:kept]
        data = dict(x=x_train, y=y_train, batch_size=batch_size)
    noise = _NOISE_MULTIPLIER.value
    if _TARGET_EPSILON.value is not None:
        noise = custom_fit.privacy.calibrate_noise(
            _TARGET_EPSILON.value,
            _DELTA.value,
            num_examples=len(x_train),
            batch_size=batch_size,
            epochs=_EPOCHS.value,
            sampling=_SAMPLING.value,
        )
    model = mlp.build(
        PrivateMLP,
        x_train.shape[1],
        l2_norm_clip=_L2_NORM_CLIP.value,
        noise_multiplier=noise,
        num_microbatches=_NUM_MICROBATCHES.value,
        expected_batch_size=batch_size if poisson else None,
        noise_seed=_PRIVATE_SEED.value,
    )
    model.compile(
        optimizer=keras.optimizers.SGD(_LEARNING_RATE.value, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    budget = callbacks.PrivacyBudget(
        num_examples=len(x_train),
        batch_size=batch_size,
        delta=_DELTA.value,
        max_epsilon=_MAX_EPSILON.value,
    )
    history = model.fit(
        **data,
        epochs=_EPOCHS.value,
        validation_data=(x_val, y_val),
        callbacks=[budget],
        verbose=2,
    )
    print(f"training examples: {len(x_train)}")
    print(f"sampling: {budget.sampling}")
    print(f"noise multiplier: {noise!r}")
    print(f"steps: {model.private_steps}")
    print(f"validation accuracy: {history.history['val_accuracy'][-1]:.4f}")
    print(f"epsilon: {budget.epsilons[-1]:.6f}")
    print(f"delta: {_DELTA.value:g}")


if __name__ == "__main__":
    app.run(main)
