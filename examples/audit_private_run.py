"""Audits the privacy guide's private run with gradient-space canaries.

The run of docs/guides/privacy.md: scikit-learn's digits, a Dense 64 -
Dense 10 network trained with DP-SGD on Poisson batches of 64 examples on
average for `--epochs`, the noise calibrated to `--target_epsilon` at
`--delta`. It is trained twice from the same weights: as it is, and with
`custom_fit.auditing.CanaryAudit` (`--num_canaries` canaries drawn as
examples are, clipped and noised in the same step). Prints the audit's
report, the time the audit added, and the validation accuracy of both
runs; exits with an error if a check fails (`audit.check`).

    python examples/audit_private_run.py --num_canaries=1000
"""

import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import custom_fit  # noqa: E402

_NUM_CANARIES = flags.DEFINE_integer("num_canaries", 1000, "Canaries.")
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Training epochs.")
_TARGET_EPSILON = flags.DEFINE_float("target_epsilon", 3.0, "Epsilon target.")
_DELTA = flags.DEFINE_float("delta", 1e-4, "Delta (below 1 / examples).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the initial weights.")


class Net(custom_fit.DifferentialPrivacyMixin, keras.Model):
    """The privacy guide's network."""


def train(x, y, noise, audit=None):
    """Trains the guide's run (with `audit`, on its canaries).

    Returns the seconds `fit` took and the final training accuracy.
    """
    keras.utils.set_random_seed(_SEED.value)
    # No seed: a secret one, drawn from the system (the draws are the
    # privacy); the noise's seed is secret too.
    # Batches padded to multiples of 32 rows: a few shapes to compile.
    sampler = custom_fit.sampling.PoissonSampler(
        x, y, batch_size=64, pad_to_multiple_of=32
    )
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(64, activation="relu")(inputs)
    model = Net(
        inputs,
        keras.layers.Dense(10)(hidden),
        l2_norm_clip=1.0,
        noise_multiplier=noise,
        expected_batch_size=sampler.batch_size,
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    data, callbacks = sampler, []
    if audit is not None:
        data, callbacks = audit.wrap(sampler), [audit]
    start = time.perf_counter()
    model.fit(data, epochs=_EPOCHS.value, callbacks=callbacks, verbose=0)
    seconds = time.perf_counter() - start
    _, accuracy = model.evaluate(x, y, verbose=0)
    return seconds, accuracy


def main(argv):
    """Trains the run plain and audited; prints the audit's report."""
    del argv
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype("float32")
    noise = custom_fit.privacy.calibrate_noise(
        target_epsilon=_TARGET_EPSILON.value,
        delta=_DELTA.value,
        num_examples=len(x),
        batch_size=64,
        epochs=_EPOCHS.value,
    )
    plain_seconds, plain_accuracy = train(x, y, noise)
    audit = custom_fit.auditing.CanaryAudit(num_canaries=_NUM_CANARIES.value)
    audited_seconds, audited_accuracy = train(x, y, noise, audit)
    print(audit.result(_DELTA.value))
    print(f"fit without the audit: {plain_seconds:.1f} s")
    print(f"fit with the audit: {audited_seconds:.1f} s")
    print(f"time added: {audited_seconds - plain_seconds:.1f} s")
    print(f"accuracy without / with: {plain_accuracy:.4f} / "
          f"{audited_accuracy:.4f}")
    audit.check(_DELTA.value)  # raises PrivacyAuditError if a check failed
    print("audit: every check passed")


if __name__ == "__main__":
    app.run(main)
