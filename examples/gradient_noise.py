"""Your own mixin with its own options: annealed gradient noise.

Neelakantan et al. 2015 ("Adding Gradient Noise Improves Learning for Very
Deep Networks") add Gaussian noise to every gradient, with a variance that
decays as `eta / (1 + t) ** gamma` over the update count `t`. Here it is a
mixin of about twenty lines, written against custom_fit's public names
only:

- two options declared with `custom_fit.options.Option`: the noise's
  standard deviation (schedulable: a float or a Keras schedule, here
  `AnnealedNoise`, the paper's decay) and its seed. The model validates
  them, lists them in `help()`, saves them in `.keras` files and refuses
  an assignment to them after it is built;
- `transform_gradients`, which sees the true gradients (unscaled, global
  across replicas) and composes with clipping and inspection;
- `option_in_step`, which evaluates the schedule at the optimizer's update
  count inside the (compiled) step and logs the value in force.

The program trains the shared MLP (examples/mlp.py) on the bundled digits
with the noise and clipping, saves the model, loads it, and prints the
options read back, the logged noise of each epoch and the validation
accuracy.

    python examples/gradient_noise.py --epochs=5
"""

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import digits  # noqa: E402  (examples/digits.py)
import keras  # noqa: E402
import mlp  # noqa: E402  (examples/mlp.py)
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from keras import ops  # noqa: E402

import custom_fit  # noqa: E402
from custom_fit import options  # noqa: E402

_EPOCHS = flags.DEFINE_integer("epochs", 5, "Training epochs.")
_ETA = flags.DEFINE_float("eta", 0.01, "Noise variance at step 0.")
_GAMMA = flags.DEFINE_float("gamma", 0.55, "Decay exponent of the variance.")


@keras.saving.register_keras_serializable(package="examples")
class AnnealedNoise(keras.optimizers.schedules.LearningRateSchedule):
    """The paper's standard deviation: `sqrt(eta / (1 + step) ** gamma)`."""

    def __init__(self, eta=0.01, gamma=0.55):
        self.eta = eta
        self.gamma = gamma

    def __call__(self, step):
        """Returns the standard deviation at update `step`."""
        step = ops.cast(step, "float32")
        return ops.sqrt(self.eta / (1.0 + step) ** self.gamma)

    def get_config(self):
        """Returns the constructor arguments, for saving."""
        return {"eta": self.eta, "gamma": self.gamma}


@keras.saving.register_keras_serializable(package="examples")
class GradientNoiseMixin(custom_fit.TrainStepMixin):
    """Adds Gaussian noise of `gradient_noise_stddev` to every gradient."""

    gradient_noise_stddev = options.Option(
        0.0, options.non_negative_float, schedulable=True
    )
    gradient_noise_seed = options.Option(
        None, options.seed_or_none, requires=("gradient_noise_stddev",)
    )
    # The noise's generator, seeded by the option above.
    noise_seeds = options.Seeds("gradient_noise_seed")

    def transform_gradients(self, gradients, variables):
        """Adds the noise, then runs the mixins after this one."""
        stddev = self.option_in_step("gradient_noise_stddev")
        gradients = [
            g
            + stddev * keras.random.normal(ops.shape(g), seed=self.noise_seeds)
            for g in gradients
        ]
        return super().transform_gradients(gradients, variables)


@keras.saving.register_keras_serializable(package="examples")
class NoisyMLP(
    GradientNoiseMixin, custom_fit.GradientClippingMixin, keras.Model
):
    """The shared MLP with annealed gradient noise, then global clipping."""


def train(epochs, eta, gamma, directory):
    """Trains, saves and loads the noisy MLP; returns what it printed."""
    (x_train, y_train), (x_val, y_val) = digits.load_digits()
    keras.utils.set_random_seed(0)
    model = mlp.build(
        NoisyMLP,
        x_train.shape[1],
        gradient_noise_stddev=AnnealedNoise(eta, gamma),
        gradient_noise_seed=1,
        global_clipnorm=1.0,
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        x_train,
        y_train,
        epochs=epochs,
        batch_size=64,
        validation_data=(x_val, y_val),
        verbose=0,
    )
    path = os.path.join(directory, "noisy.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    schedule = loaded.gradient_noise_stddev
    lines = [
        f"loaded: {type(loaded).__name__}, gradient_noise_stddev="
        f"AnnealedNoise(eta={schedule.eta}, gamma={schedule.gamma}), "
        f"gradient_noise_seed={loaded.gradient_noise_seed}, "
        f"global_clipnorm={loaded.global_clipnorm}"
    ]
    for epoch, noise in enumerate(history.history["gradient_noise_stddev"]):
        lines.append(f"epoch {epoch + 1}: gradient_noise_stddev {noise:.5f}")
    accuracy = history.history["val_accuracy"][-1]
    lines.append(f"validation accuracy: {accuracy:.3f}")
    return lines


def main(argv):
    """Trains, saves, loads and prints."""
    del argv
    with tempfile.TemporaryDirectory() as directory:
        for line in train(_EPOCHS.value, _ETA.value, _GAMMA.value, directory):
            print(line)


if __name__ == "__main__":
    app.run(main)
