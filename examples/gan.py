"""A GAN trained with `fit`: two networks, two optimizers, one pipeline each.

The seed documents' hardest case, and the usual reason to leave `fit` for a
hand-written loop. Here the GAN is a custom_fit model whose `train_step`
computes both losses from one forward pass and calls `minimize` on each
network with that network's optimizer. The noise comes with the data, drawn
in the `tf.data` pipeline. Each network is itself a custom_fit
model, configured on its own:

- the discriminator clips its gradient (`global_clipnorm`) and is
  inspected;
- the generator is inspected, unclipped.

Both networks log their global gradient norm under their names
(`discriminator_grad_norm`, `generator_grad_norm`; the discriminator's
clipping also `discriminator_grad_norm_clipped` and
`discriminator_clip_rate`), and `model.generator.gradient_norms`
holds per-layer norms for callbacks. At the end the program saves a PNG
grid of generated digits.

    python examples/gan.py --epochs=30 --output=gan_digits.png
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import digits  # noqa: E402  (examples/digits.py)
import keras  # noqa: E402
import matplotlib  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402

import custom_fit  # noqa: E402

matplotlib.use("Agg")
from matplotlib import pyplot  # noqa: E402

_DATASET = flags.DEFINE_enum(
    "dataset", "digits", digits.DATASETS, "digits (bundled) or mnist."
)
_EPOCHS = flags.DEFINE_integer("epochs", 30, "Training epochs.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Batch size.")
_LATENT_DIM = flags.DEFINE_integer("latent_dim", 16, "Generator input size.")
_CLIPNORM = flags.DEFINE_float(
    "discriminator_clipnorm", 1.0, "Global norm bound, discriminator only."
)
_OUTPUT = flags.DEFINE_string("output", "gan_digits.png", "PNG to write.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")


class Generator(custom_fit.GradientInspectionMixin, keras.Model):
    """Noise to pixels in [0, 1]; gradients inspected, not clipped."""


class Discriminator(
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    """Pixels to a real/fake logit; gradients clipped and inspected."""


class GAN(custom_fit.TrainStepMixin, keras.Model):
    """Trains `generator` against `discriminator` with `fit`.

    Batches are `(real_samples, noise)`: the noise comes with the data (see
    `with_noise`), which keeps the step deterministic and makes a run under
    `tf.distribute` equal the single-device run. Both losses come from one
    forward pass; each network is then updated through its own gradient
    pipeline (`minimize`), with its optimizer.

    Args:
        generator: A custom_fit model from noise to samples.
        discriminator: A custom_fit model from samples to one logit.
    """

    def __init__(self, generator, discriminator, **kwargs):
        super().__init__(**kwargs)
        self.generator = generator
        self.discriminator = discriminator
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)
        self.built = True  # Both networks are built already.

    def compile(self, generator_optimizer, discriminator_optimizer):
        """Sets the two optimizers and builds them for their networks."""
        super().compile()
        self.generator_optimizer = generator_optimizer
        self.discriminator_optimizer = discriminator_optimizer
        generator_optimizer.build(self.generator.trainable_variables)
        discriminator_optimizer.build(self.discriminator.trainable_variables)

    def train_step(self, data):
        """One simultaneous update of both networks on a batch."""
        real, noise, _ = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as g_tape, tf.GradientTape() as d_tape:
            fake = self.generator(noise, training=True)
            real_logits = self.discriminator(real, training=True)
            fake_logits = self.discriminator(fake, training=True)
            d_loss = self.bce(
                tf.ones_like(real_logits), real_logits
            ) + self.bce(tf.zeros_like(fake_logits), fake_logits)
            g_loss = self.bce(tf.ones_like(fake_logits), fake_logits)
        self.discriminator.minimize(
            d_loss, d_tape, optimizer=self.discriminator_optimizer
        )
        self.generator.minimize(
            g_loss, g_tape, optimizer=self.generator_optimizer
        )
        # Keras' losses divide by the replica count under tf.distribute.
        replicas = custom_fit.pipeline.replica_count()
        self.report_metric("d_loss", d_loss * replicas)
        self.report_metric("g_loss", g_loss * replicas)
        return self.get_metrics_result()


def with_noise(samples, latent_dim, batch_size, seed):
    """Returns an endless dataset of `(real batch, noise batch)`.

    Each pass over `samples` is reshuffled and gets new noise; a given
    `seed` gives the same batches in every run. The dataset repeats
    forever: train on it with `steps_per_epoch=len(samples) // batch_size`,
    one pass per epoch (full batches only, the remainder is dropped).

    Args:
        samples: Array of real samples.
        latent_dim: Integer, the size of the generator's input.
        batch_size: Integer.
        seed: Integer, for the shuffle and the noise.

    Returns:
        A `tf.data.Dataset`.
    """
    data = tf.data.Dataset.from_tensor_slices(samples)
    data = data.shuffle(len(samples), seed=seed)
    data = data.batch(batch_size, drop_remainder=True).repeat()
    # One iterator serves every epoch, so the seeded noise op continues its
    # sequence. On a finite dataset `fit` makes a new iterator per epoch,
    # and the op would restart, giving every epoch the same noise.
    return data.map(
        lambda real: (
            real,
            tf.random.normal((tf.shape(real)[0], latent_dim), seed=seed),
        )
    )


def build_gan(features, latent_dim, discriminator_clipnorm):
    """Returns the GAN: two small MLPs."""
    noise = keras.Input((latent_dim,))
    x = keras.layers.Dense(128, activation="relu", name="g_dense_1")(noise)
    x = keras.layers.Dense(128, activation="relu", name="g_dense_2")(x)
    pixels = keras.layers.Dense(
        features, activation="sigmoid", name="g_pixels"
    )(x)
    generator = Generator(noise, pixels, name="generator")

    sample = keras.Input((features,))
    x = keras.layers.Dense(128, name="d_dense_1")(sample)
    x = keras.layers.LeakyReLU(0.2)(x)
    x = keras.layers.Dense(64, name="d_dense_2")(x)
    x = keras.layers.LeakyReLU(0.2)(x)
    logit = keras.layers.Dense(1, name="d_logit")(x)
    discriminator = Discriminator(
        sample,
        logit,
        global_clipnorm=discriminator_clipnorm,
        name="discriminator",
    )
    return GAN(generator, discriminator)


def save_grid(images, path, columns=8):
    """Saves square grayscale images as a PNG grid."""
    side = digits.image_side(images.shape[1])
    rows = int(np.ceil(len(images) / columns))
    figure, axes = pyplot.subplots(
        rows, columns, figsize=(columns, rows), squeeze=False
    )
    for axis in axes.ravel():
        axis.axis("off")
    for axis, image in zip(axes.ravel(), images):
        axis.imshow(image.reshape(side, side), cmap="gray_r", vmin=0, vmax=1)
    figure.tight_layout()
    figure.savefig(path)
    pyplot.close(figure)


def main(argv):
    """Trains the GAN and writes a grid of generated images."""
    del argv
    keras.utils.set_random_seed(_SEED.value)
    (x_train, _), _ = digits.load_dataset(_DATASET.value, _SEED.value)
    gan = build_gan(x_train.shape[1], _LATENT_DIM.value, _CLIPNORM.value)
    gan.compile(
        generator_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5),
        discriminator_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5),
    )
    data = with_noise(
        x_train, _LATENT_DIM.value, _BATCH_SIZE.value, _SEED.value
    )
    history = gan.fit(
        data,
        epochs=_EPOCHS.value,
        steps_per_epoch=len(x_train) // _BATCH_SIZE.value,
        verbose=2,
    )
    for name, values in sorted(history.history.items()):
        print(f"{name}: {values[-1]:.4f}")
    norms = ", ".join(
        f"{layer}={norm:.3g}"
        for layer, norm in gan.generator.gradient_norms.items()
    )
    print(f"generator gradient norms by layer: {norms}")
    noise = np.random.RandomState(_SEED.value).randn(32, _LATENT_DIM.value)
    samples = gan.generator.predict(noise.astype("float32"), verbose=0)
    save_grid(samples, _OUTPUT.value)
    print(
        f"generated mean pixel: {samples.mean():.3f} "
        f"(data: {x_train.mean():.3f})"
    )
    print(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
    app.run(main)
