"""Differentially private fine-tuning of LoRA adapters only, on digits.

The shared MLP of examples/mlp.py is first trained without privacy on a
small "public" part of scikit-learn's bundled digits (`--public_fraction`
of the training images). Its Dense layers then get LoRA adapters
(`layer.enable_lora(--lora_rank)`: the kernel is frozen and a low-rank
update `A @ B` is trained in its place); the biases are frozen too, so
that only the adapters train. They are fine-tuned with DP-SGD
(`custom_fit.DifferentialPrivacyMixin`) on the rest of the training
images, the "private" part: Poisson-sampled batches
(`custom_fit.sampling.PoissonSampler`), the noise calibrated to spend
`--target_epsilon` at `--delta` over `--epochs`
(`custom_fit.privacy.calibrate_noise`), and `callbacks.PrivacyBudget`
accounting each epoch. Only the adapters see the private data, and only
they are clipped and noised: far fewer numbers than the whole network.

Prints the trainable parameters, the validation accuracy after public
training and after private fine-tuning, the private steps and the epsilon
spent.

    python examples/private_lora.py
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import digits  # noqa: E402  (examples/digits.py)
import keras  # noqa: E402
import mlp  # noqa: E402  (examples/mlp.py)
import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import custom_fit  # noqa: E402
from custom_fit import callbacks  # noqa: E402

_PUBLIC_FRACTION = flags.DEFINE_float(
    "public_fraction", 0.1, "Share of the training images trained on openly."
)
_PUBLIC_EPOCHS = flags.DEFINE_integer(
    "public_epochs", 30, "Epochs of (non-private) training on the public part."
)
_LORA_RANK = flags.DEFINE_integer("lora_rank", 4, "Rank of the adapters.")
_TARGET_EPSILON = flags.DEFINE_float(
    "target_epsilon", 3.0, "Epsilon spent by the private fine-tuning."
)
_DELTA = flags.DEFINE_float(
    "delta", 1e-4, "Target delta, below 1 / (number of private examples)."
)
_L2_NORM_CLIP = flags.DEFINE_float(
    "l2_norm_clip", 1.0, "Bound of each example's gradient norm."
)
_EPOCHS = flags.DEFINE_integer("epochs", 10, "Private fine-tuning epochs.")
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", 64, "Expected size of the Poisson-sampled batches."
)
_LEARNING_RATE = flags.DEFINE_float(
    "learning_rate", 0.1, "SGD step size of the fine-tuning (momentum 0.9)."
)
_SEED = flags.DEFINE_integer("seed", 0, "Random seed (split, weights).")
_PRIVATE_SEED = flags.DEFINE_integer(
    "private_seed",
    None,
    "Seed of the noise and the sampler. Default: secret, drawn from the "
    "system; a seed makes them reproducible by whoever knows it.",
)


class PrivateMLP(custom_fit.DifferentialPrivacyMixin, keras.Model):
    """A functional model fine-tuned with DP-SGD."""


def loss():
    """The loss of both phases (the model outputs logits)."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def public_model(x_public, y_public, x_val, y_val):
    """Trains the MLP without privacy on the public part; returns it."""
    model = mlp.build(keras.Model, x_public.shape[1])
    model.compile(optimizer="adam", loss=loss(), metrics=["accuracy"])
    model.fit(
        x_public,
        y_public,
        batch_size=32,
        epochs=_PUBLIC_EPOCHS.value,
        verbose=0,
    )
    return model


def with_adapters(trained, noise, batch_size):
    """The trained MLP as a private model where only LoRA adapters train."""
    model = mlp.build(
        PrivateMLP,
        trained.input_shape[-1],
        l2_norm_clip=_L2_NORM_CLIP.value,
        noise_multiplier=noise,
        expected_batch_size=batch_size,
        noise_seed=_PRIVATE_SEED.value,
    )
    model.set_weights(trained.get_weights())
    for layer in model.layers:
        if isinstance(layer, keras.layers.Dense):
            layer.enable_lora(_LORA_RANK.value)
            layer.bias.trainable = False
    return model


def main(argv):
    """Trains openly, fine-tunes the adapters privately, prints figures."""
    del argv
    keras.utils.set_random_seed(_SEED.value)
    (x_train, y_train), (x_val, y_val) = digits.load_digits(_SEED.value)
    order = np.random.RandomState(_SEED.value).permutation(len(x_train))
    public = order[: int(_PUBLIC_FRACTION.value * len(x_train))]
    private = order[len(public) :]
    x_private, y_private = x_train[private], y_train[private]
    trained = public_model(x_train[public], y_train[public], x_val, y_val)
    _, public_accuracy = trained.evaluate(x_val, y_val, verbose=0)

    batch_size = _BATCH_SIZE.value
    noise = custom_fit.privacy.calibrate_noise(
        _TARGET_EPSILON.value,
        _DELTA.value,
        num_examples=len(x_private),
        batch_size=batch_size,
        epochs=_EPOCHS.value,
        sampling="poisson",
    )
    model = with_adapters(trained, noise, batch_size)
    model.compile(
        optimizer=keras.optimizers.SGD(_LEARNING_RATE.value, momentum=0.9),
        loss=loss(),
        metrics=["accuracy"],
    )
    budget = callbacks.PrivacyBudget(
        num_examples=len(x_private), batch_size=batch_size, delta=_DELTA.value
    )
    history = model.fit(
        custom_fit.sampling.PoissonSampler(
            x_private, y_private, batch_size, seed=_PRIVATE_SEED.value
        ),
        epochs=_EPOCHS.value,
        validation_data=(x_val, y_val),
        callbacks=[budget],
        verbose=2,
    )
    trainable = [v.path for v in model.trainable_variables]
    print(f"public examples: {len(public)}")
    print(f"private examples: {len(x_private)}")
    print(f"trainable variables: {', '.join(trainable)}")
    print(
        "trainable parameters: "
        f"{sum(int(np.prod(v.shape)) for v in model.trainable_variables)} "
        f"of {sum(int(np.prod(v.shape)) for v in model.weights)}"
    )
    print(f"public accuracy: {public_accuracy:.4f}")
    print(f"noise multiplier: {noise!r}")
    print(f"steps: {model.private_steps}")
    print(f"validation accuracy: {history.history['val_accuracy'][-1]:.4f}")
    print(f"epsilon: {budget.epsilons[-1]:.6f}")
    print(f"delta: {_DELTA.value:g}")


if __name__ == "__main__":
    app.run(main)
