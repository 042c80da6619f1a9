"""A GAN trained with `fit`: two networks, two optimizers, one pipeline each.

The hardest case for `fit`, and the usual reason to leave it for a
hand-written loop. Here the GAN is a custom_fit model whose `train_step`
updates each network through its own gradient pipeline, with its own
optimizer, by calling `minimize` on it with a loss function:

    self.discriminator.minimize(discriminator_loss, optimizer=...)
    self.generator.minimize(generator_loss, optimizer=...)

The updates alternate, as in Keras' own DCGAN example: the discriminator
first, on real samples against the generator's samples of a fresh noise
batch; then the generator, on another fresh noise batch, against the
updated discriminator. The noise comes from a seeded
`keras.random.SeedGenerator` in the GAN's state, and the step is written
with `keras.ops`, so the program runs unchanged on TensorFlow and on JAX
(`KERAS_BACKEND`). Each network is itself a custom_fit model, configured
on its own:

- the discriminator clips its gradient (`global_clipnorm`) and is
  inspected;
- the generator is inspected, unclipped.

History holds both losses (`d_loss`, `g_loss`) and each network's global
gradient norm under its name (`discriminator_grad_norm`,
`generator_grad_norm`; the discriminator's clipping also
`discriminator_grad_norm_clipped` and `discriminator_clip_rate`), and
`model.generator.gradient_norms` holds per-layer norms for callbacks. At
the end the program saves a PNG grid of generated digits.

    python examples/gan.py --epochs=30 --output=gan_digits.png
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import digits  # noqa: E402  (examples/digits.py)
import keras  # noqa: E402
import numpy as np  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from keras import ops  # noqa: E402

import custom_fit  # noqa: E402

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

    Batches hold real samples only. Each step draws two noise batches from
    the GAN's seeded `SeedGenerator`: one for the discriminator's update,
    one for the generator's, which follows it (alternating updates). Each
    network is updated through its own gradient pipeline (`minimize`),
    with its optimizer. (Under `tf.distribute`, every replica draws the
    same noise for its share of the batch.)

    Args:
        generator: A custom_fit model from noise to samples.
        discriminator: A custom_fit model from samples to one logit.
        latent_dim: Integer, the size of the generator's input.
        seed: Integer, the seed of the noise draws.
    """

    def __init__(self, generator, discriminator, latent_dim, seed=0, **kwargs):
        super().__init__(**kwargs)
        self.generator = generator
        self.discriminator = discriminator
        self.latent_dim = latent_dim
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.bce = keras.losses.BinaryCrossentropy(from_logits=True)
        self.built = True  # Both networks are built already.

    def compile(self, generator_optimizer, discriminator_optimizer):
        """Sets the two optimizers and builds them for their networks."""
        super().compile()
        self.generator_optimizer = generator_optimizer
        self.discriminator_optimizer = discriminator_optimizer
        generator_optimizer.build(self.generator.trainable_variables)
        discriminator_optimizer.build(self.discriminator.trainable_variables)

    def discriminator_step(self, real, noise):
        """One discriminator update: real samples against generated ones."""
        fake = self.generator(noise, training=True)

        def discriminator_loss():
            real_logits = self.discriminator(real, training=True)
            fake_logits = self.discriminator(fake, training=True)
            loss = self.bce(ops.ones_like(real_logits), real_logits) + (
                self.bce(ops.zeros_like(fake_logits), fake_logits)
            )
            self.report_metric("d_loss", loss * self.replicas())
            return loss

        self.discriminator.minimize(
            discriminator_loss, optimizer=self.discriminator_optimizer
        )

    def generator_step(self, noise):
        """One generator update: make the discriminator call fakes real."""

        def generator_loss():
            fake_logits = self.discriminator(
                self.generator(noise, training=True), training=True
            )
            loss = self.bce(ops.ones_like(fake_logits), fake_logits)
            self.report_metric("g_loss", loss * self.replicas())
            return loss

        self.generator.minimize(
            generator_loss, optimizer=self.generator_optimizer
        )

    def train_step(self, data):
        """The discriminator's update, then the generator's, on a batch."""
        real, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        batch_size = ops.shape(real)[0]
        self.discriminator_step(real, self.noise(batch_size))
        self.generator_step(self.noise(batch_size))
        return self.get_metrics_result()

    def noise(self, batch_size):
        """Returns a fresh batch of the generator's input noise."""
        return keras.random.normal(
            (batch_size, self.latent_dim), seed=self.seed_generator
        )

    @staticmethod
    def replicas():
        """Returns the replica count (1 on JAX), to log global-batch losses.

        Keras' losses divide by it under `tf.distribute`.
        """
        return custom_fit.pipeline.replica_count()


def build_gan(features, latent_dim, discriminator_clipnorm, seed=0):
    """Returns the GAN: two small MLPs."""
    init = keras.initializers.GlorotUniform
    noise = keras.Input((latent_dim,))
    x = keras.layers.Dense(
        128, activation="relu", kernel_initializer=init(seed), name="g_dense_1"
    )(noise)
    x = keras.layers.Dense(
        128,
        activation="relu",
        kernel_initializer=init(seed + 1),
        name="g_dense_2",
    )(x)
    pixels = keras.layers.Dense(
        features,
        activation="sigmoid",
        kernel_initializer=init(seed + 2),
        name="g_pixels",
    )(x)
    generator = Generator(noise, pixels, name="generator")

    sample = keras.Input((features,))
    x = keras.layers.Dense(
        128, kernel_initializer=init(seed + 3), name="d_dense_1"
    )(sample)
    x = keras.layers.LeakyReLU(0.2)(x)
    x = keras.layers.Dense(
        64, kernel_initializer=init(seed + 4), name="d_dense_2"
    )(x)
    x = keras.layers.LeakyReLU(0.2)(x)
    logit = keras.layers.Dense(
        1, kernel_initializer=init(seed + 5), name="d_logit"
    )(x)
    discriminator = Discriminator(
        sample,
        logit,
        global_clipnorm=discriminator_clipnorm,
        name="discriminator",
    )
    return GAN(generator, discriminator, latent_dim, seed)


def save_grid(images, path, columns=8):
    """Saves square grayscale images as a PNG grid."""
    from matplotlib import figure

    side = digits.image_side(images.shape[1])
    rows = int(np.ceil(len(images) / columns))
    canvas = figure.Figure(figsize=(columns, rows))
    axes = canvas.subplots(rows, columns, squeeze=False)
    for axis in axes.ravel():
        axis.axis("off")
    for axis, image in zip(axes.ravel(), images):
        axis.imshow(image.reshape(side, side), cmap="gray_r", vmin=0, vmax=1)
    canvas.tight_layout()
    canvas.savefig(path)


def main(argv):
    """Trains the GAN and writes a grid of generated images."""
    del argv
    keras.utils.set_random_seed(_SEED.value)
    (x_train, _), _ = digits.load_dataset(_DATASET.value, _SEED.value)
    gan = build_gan(
        x_train.shape[1], _LATENT_DIM.value, _CLIPNORM.value, _SEED.value
    )
    gan.compile(
        generator_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5),
        discriminator_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5),
    )
    # Full batches only: a smaller last batch would trace the step again.
    steps = len(x_train) // _BATCH_SIZE.value
    history = gan.fit(
        x_train[: steps * _BATCH_SIZE.value],
        batch_size=_BATCH_SIZE.value,
        epochs=_EPOCHS.value,
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
