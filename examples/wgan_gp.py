"""WGAN-GP with `fit`: the critic's gradient penalty comes from the library.

The Wasserstein GAN with gradient penalty (Gulrajani et al., 2017,
"Improved Training of Wasserstein GANs"), as Keras' own WGAN-GP example
trains it: several critic updates per generator update, each on

    mean(D(fake)) - mean(D(real)) + 10 * mean((||grad D(x_hat)|| - 1)^2)

with `x_hat` a random point between a real and a fake sample. Here the
penalty is not written by hand: the critic is a custom_fit model with
`input_gradient_penalty=10, input_gradient_penalty_form="wgan_gp"`, and the
WGAN's step names the points it is taken at:

    self.critic.minimize(critic_loss, optimizer=...,
                         penalty_inputs=interpolated)

The critic's gradient can also be clipped (`--critic_clipnorm`), and
both networks' gradients are inspected. History holds `d_loss`, `g_loss`,
`critic_input_gradient_penalty`, `critic_grad_norm` and
`generator_grad_norm`. The step is written with `keras.ops` and
`keras.random`, and the noise comes from a seeded `SeedGenerator`.

    python examples/wgan_gp.py --epochs=20 --output=wgan_digits.png
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
_EPOCHS = flags.DEFINE_integer("epochs", 20, "Training epochs.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Batch size.")
_LATENT_DIM = flags.DEFINE_integer("latent_dim", 16, "Generator input size.")
_CRITIC_STEPS = flags.DEFINE_integer(
    "critic_steps", 3, "Critic updates per generator update."
)
_GP_WEIGHT = flags.DEFINE_float("gp_weight", 10.0, "Gradient-penalty weight.")
_CRITIC_CLIPNORM = flags.DEFINE_float(
    "critic_clipnorm", None, "Global norm bound of the critic's gradient."
)
_OUTPUT = flags.DEFINE_string("output", "wgan_digits.png", "PNG to write.")
_SEED = flags.DEFINE_integer("seed", 0, "Random seed.")


class Critic(
    custom_fit.RegularizationMixin,
    custom_fit.GradientClippingMixin,
    custom_fit.GradientInspectionMixin,
    keras.Model,
):
    """Samples to one score; penalized, optionally clipped, inspected."""


class Generator(custom_fit.GradientInspectionMixin, keras.Model):
    """Noise to pixels in [0, 1]; inspected."""


class WGANGP(custom_fit.TrainStepMixin, keras.Model):
    """Trains `generator` against `critic` with `fit`.

    Args:
        generator: A custom_fit model from noise to samples.
        critic: A custom_fit model from samples to one score, built with
            `input_gradient_penalty` and `input_gradient_penalty_form=
            "wgan_gp"`.
        latent_dim: Integer, the size of the generator's input.
        critic_steps: Integer, critic updates per batch.
        seed: Integer, the seed of the noise and interpolation draws.
    """

    def __init__(
        self, generator, critic, latent_dim, critic_steps=3, seed=0, **kwargs
    ):
        super().__init__(**kwargs)
        self.generator = generator
        self.critic = critic
        self.latent_dim = latent_dim
        self.critic_steps = critic_steps
        self.seed_generator = keras.random.SeedGenerator(seed)
        self.built = True  # Both networks are built already.

    def compile(self, generator_optimizer, critic_optimizer):
        """Sets the two optimizers and builds them for their networks."""
        super().compile()
        self.generator_optimizer = generator_optimizer
        self.critic_optimizer = critic_optimizer
        generator_optimizer.build(self.generator.trainable_variables)
        critic_optimizer.build(self.critic.trainable_variables)

    def critic_step(self, real, noise, alpha):
        """One critic update on `real` against the generator's `noise`.

        The penalty is taken at `real + alpha * (fake - real)`.
        """
        fake = self.generator(noise, training=True)
        interpolated = real + alpha * (fake - real)

        def critic_loss():
            loss = ops.mean(self.critic(fake, training=True)) - ops.mean(
                self.critic(real, training=True)
            )
            self.report_metric("d_loss", loss)
            return loss

        self.critic.minimize(
            critic_loss,
            optimizer=self.critic_optimizer,
            penalty_inputs=interpolated,
        )

    def generator_step(self, noise):
        """One generator update: raise the critic's score of its samples."""

        def generator_loss():
            fake = self.generator(noise, training=True)
            loss = -ops.mean(self.critic(fake, training=True))
            self.report_metric("g_loss", loss)
            return loss

        self.generator.minimize(
            generator_loss, optimizer=self.generator_optimizer
        )

    def train_step(self, data):
        """`critic_steps` critic updates, then one generator update."""
        real, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        batch_size = ops.shape(real)[0]
        for _ in range(self.critic_steps):
            self.critic_step(
                real, self.noise(batch_size), self.alpha(batch_size)
            )
        self.generator_step(self.noise(batch_size))
        return self.get_metrics_result()

    def noise(self, batch_size):
        """Returns a batch of the generator's input noise."""
        return keras.random.normal(
            (batch_size, self.latent_dim), seed=self.seed_generator
        )

    def alpha(self, batch_size):
        """Returns one interpolation weight in [0, 1) per sample."""
        return keras.random.uniform((batch_size, 1), seed=self.seed_generator)


def build_wgan(
    features,
    latent_dim,
    gp_weight=10.0,
    critic_clipnorm=None,
    critic_steps=3,
    seed=0,
):
    """Returns the WGAN-GP: two small MLPs."""
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
    x = keras.layers.Dense(128, kernel_initializer=init(seed + 3), name="c_1")(
        sample
    )
    x = keras.layers.LeakyReLU(0.2)(x)
    x = keras.layers.Dense(64, kernel_initializer=init(seed + 4), name="c_2")(x)
    x = keras.layers.LeakyReLU(0.2)(x)
    score = keras.layers.Dense(
        1, kernel_initializer=init(seed + 5), name="c_score"
    )(x)
    critic = Critic(
        sample,
        score,
        input_gradient_penalty=gp_weight,
        input_gradient_penalty_form="wgan_gp",
        global_clipnorm=critic_clipnorm,
        name="critic",
    )
    return WGANGP(generator, critic, latent_dim, critic_steps, seed)


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
    """Trains the WGAN-GP and writes a grid of generated images."""
    del argv
    keras.utils.set_random_seed(_SEED.value)
    (x_train, _), _ = digits.load_dataset(_DATASET.value, _SEED.value)
    wgan = build_wgan(
        x_train.shape[1],
        _LATENT_DIM.value,
        _GP_WEIGHT.value,
        _CRITIC_CLIPNORM.value,
        _CRITIC_STEPS.value,
        _SEED.value,
    )
    wgan.compile(
        generator_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5, beta_2=0.9),
        critic_optimizer=keras.optimizers.Adam(2e-4, beta_1=0.5, beta_2=0.9),
    )
    steps = len(x_train) // _BATCH_SIZE.value
    history = wgan.fit(
        x_train[: steps * _BATCH_SIZE.value],
        batch_size=_BATCH_SIZE.value,
        epochs=_EPOCHS.value,
        verbose=2,
    )
    for key, values in sorted(history.history.items()):
        print(f"{key}: {values[-1]:.6g}")
    noise = keras.random.normal((32, _LATENT_DIM.value), seed=_SEED.value)
    save_grid(keras.ops.convert_to_numpy(wgan.generator(noise)), _OUTPUT.value)
    print(f"wrote {_OUTPUT.value}")


if __name__ == "__main__":
    app.run(main)
