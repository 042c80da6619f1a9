"""The accountant and DP-SGD's arithmetic: `custom_fit.privacy`'s names.

Clipping (`clip_and_sum`, `clip_factors`), the noise (`add_noise`), what a
run spends (`epsilon`, `calibrate_noise`, `CalibratedNoise`), and the
helpers `DifferentialPrivacyMixin.fit` checks a run with. The package's
docstring tells DP-SGD; these names are exported there.
"""

import contextlib
import hashlib
import logging
import math
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

from keras import ops

from custom_fit import _gradient_ops
from custom_fit import _validation
from custom_fit import backend
from custom_fit._types import Tensor

__all__ = [
    "ACCOUNTANTS",
    "SAMPLINGS",
    "CalibratedNoise",
    "add_noise",
    "calibrate_noise",
    "clip_and_sum",
    "clip_factors",
    "epsilon",
]


ACCOUNTANTS = ("rdp", "pld")
SAMPLINGS = ("poisson", "shuffle")
# The range `calibrate_noise` searches. Below MIN_NOISE no run is private
# in any useful sense; above MAX_NOISE the accountants' epsilon stops
# falling (their conversions to (epsilon, delta) have a floor).
MIN_NOISE = 1e-2
MAX_NOISE = 1e4
# `calibrate_noise` stops within this share below the target.
_CALIBRATION_RTOL = 5e-3


def clip_and_sum(
    per_microbatch_gradients: Sequence[Tensor],
    l2_norm_clip: Any,
    mask: Any = None,
) -> tuple[list[Tensor], Tensor]:
    """Clips each microbatch's gradient in global norm, then sums them.

    A microbatch whose gradient norm is not finite (a NaN or an Inf in its
    gradient, or a norm beyond float32's range) contributes zero: it is
    treated as a zero gradient, which is within any bound. So the sum is
    finite whatever one microbatch holds, and no decision about the step
    depends on one example's data.

    Args:
        per_microbatch_gradients: List, one per variable, of tensors whose
            first axis is the microbatch: entry `[m]` is microbatch `m`'s
            gradient of that variable.
        l2_norm_clip: Positive float (or scalar tensor), the bound of each
            microbatch's gradient norm over all variables together.
        mask: Boolean vector (one per microbatch) or `None`. A microbatch
            whose entry is false contributes zero (a padding row).

    Returns:
        A tuple `(sums, norms)`: the list of summed clipped gradients, one
        per variable, and the vector of each microbatch's norm before
        clipping (NaN or Inf for a microbatch that contributed zero).

    Example:

    ```python
    >>> sums, norms = clip_and_sum([np.array([[3.0, 4.0], [0.3, 0.4]])], 1.0)
    >>> ops.convert_to_numpy(norms), ops.convert_to_numpy(sums[0])
    (array([5. , 0.5], dtype=float32), array([0.9, 1.2], dtype=float32))
    ```
    """
    gradients = [
        ops.cast(ops.convert_to_tensor(g), "float32")
        for g in per_microbatch_gradients
    ]
    squares = [_gradient_ops.squared_sums_per_slice(g) for g in gradients]
    norms = ops.sqrt(ops.sum(ops.stack(squares), axis=0))
    finite = ops.isfinite(norms)
    factors = clip_factors(norms, l2_norm_clip, mask)
    # A zero factor is not enough: 0 * NaN is NaN. The gradients of a
    # non-finite microbatch are replaced by zeros before the sum.
    gradients = [ops.where(_per_row(finite, g), g, 0.0) for g in gradients]
    # The factor-weighted sum over the microbatches as a contraction, not
    # a product then a sum: XLA then fuses each variable's per-example
    # gradients into one matrix product (a private step of the examples'
    # MLP on JAX, batch 64: 32 ms of CPU with the product and the sum,
    # 7.6 ms with the contraction).
    sums = [ops.tensordot(factors, g, axes=1) for g in gradients]
    return sums, norms


def clip_factors(norms: Tensor, l2_norm_clip: Any, mask: Any = None) -> Tensor:
    """Returns the factor that clips each microbatch's gradient.

    `min(1, l2_norm_clip / norm)`; 0 for a norm that is not finite (its
    gradient counts as zero) and where `mask` is false.

    Args:
        norms: Float vector, each microbatch's gradient norm.
        l2_norm_clip: Positive float or scalar tensor, the bound.
        mask: Boolean vector or `None`, as in `clip_and_sum`.

    Returns:
        A float vector of the norms' dtype.

    Example:

    ```python
    >>> ops.convert_to_numpy(clip_factors(np.array([4.0, 0.5, np.nan]), 2.0))
    array([0.5, 1. , 0. ])
    ```
    """
    factors = ops.where(
        ops.isfinite(norms),
        ops.minimum(1.0, l2_norm_clip / ops.maximum(norms, 1e-30)),
        0.0,
    )
    if mask is not None:
        factors = factors * ops.cast(mask, factors.dtype)
    return factors


def _per_row(flags: Tensor, tensor: Tensor) -> Tensor:
    """Returns the vector `flags` shaped to broadcast over `tensor`'s rows."""
    return ops.reshape(flags, (-1,) + (1,) * (len(tensor.shape) - 1))


def add_noise(
    gradients: Sequence[Tensor], stddev: Any, seeds: Any
) -> list[Tensor]:
    """Adds independent Gaussian noise of standard deviation `stddev`.

    Args:
        gradients: List of tensors of one floating dtype.
        stddev: Float or scalar tensor, the noise's standard deviation.
        seeds: A `keras.random.SeedGenerator`, advanced by the draws (once
            per tensor on TensorFlow, once per dtype on JAX and PyTorch).

    Returns:
        The list of noisy tensors.
    """
    return backend.current().add_noise(list(gradients), stddev, seeds)


def stream_key(seed: int, updates: int, start: bytes) -> int:
    """Returns the key of a run's stream from a given seed.

    A run with a given seed (`noise_seed`, a sampler's `seed`) draws from
    a stream keyed with where it starts: the model's update count and a
    digest of its weights. The same seed and the same starting model give
    the same run (reproducible); a run that continues an earlier one (a
    loaded model, `BackupAndRestore`, weights loaded into a new model)
    starts elsewhere, and draws none of the earlier run's noise or batches.

    Args:
        seed: Integer >= 0, the given seed.
        updates: Integer >= 0, the updates the model had made.
        start: Bytes, a digest of the model's weights when the run starts.

    Returns:
        An integer in `[0, 2**31)`.
    """
    digest = hashlib.blake2b(f"{seed}:{updates}:".encode() + start)
    return int.from_bytes(digest.digest()[:8], "little") % (2**31 - 1)


def epsilon(
    steps: int | None = None,
    batch_size: int | None = None,
    num_examples: int | None = None,
    noise_multiplier: float | None = None,
    delta: float | None = None,
    accountant: str = "rdp",
    sampling: str = "poisson",
    epochs: int | None = None,
) -> float:
    """Returns the epsilon that `steps` private steps spend at `delta`.

    Computed by Google's `dp-accounting` package, with Rényi DP (`"rdp"`,
    the default) or privacy loss distributions (`"pld"`, tighter), for the
    way the batches were drawn:

    - `sampling="poisson"`: each step is the Gaussian mechanism on a batch
      in which every example is included independently with probability
      `batch_size / num_examples` (dp-accounting's `PoissonSampledDpEvent`),
      composed `steps` times. Exact for batches drawn by
      `custom_fit.sampling.PoissonSampler` and trained with the model's
      `expected_batch_size` set.
    - `sampling="shuffle"`: `fit`'s own batches (the data shuffled each
      epoch and cut into batches of `batch_size`, so that each example is
      in one step per epoch). No accountant computes the amplification
      that shuffling gives, and the Poisson figure is not a bound for it;
      this is the bound that holds: each example's one step per epoch is a
      Gaussian mechanism, composed once per epoch begun (`ceil(steps /
      ceil(num_examples / batch_size))` epochs, for steps of whole
      passes), amplification not counted. Fits that stop within a pass
      each begin one: `custom_fit.callbacks.PrivacyBudget` counts them
      (pass it `epochs=` for the passes begun).

    Both are for one example's presence or absence, its gradient replaced
    by zero (for Poisson sampling with a fixed divisor, the same as adding
    or removing it). With microbatches of several examples, one example
    can move its microbatch's clipped gradient by twice the clip: pass
    `noise_multiplier / 2` (`custom_fit.callbacks.PrivacyBudget` does).

    Args:
        steps: Integer >= 0 or `None`. The number of private steps run
            (skipped updates included). Pass `steps` or `epochs`, not both.
        batch_size: Integer >= 1, the (expected) batch size.
        num_examples: Integer >= `batch_size`, the training set's size.
        noise_multiplier: Float > 0.
        delta: Float in (0, 1 / num_examples).
        accountant: `"rdp"` or `"pld"`.
        sampling: `"poisson"` or `"shuffle"`, how the batches were drawn.
        epochs: Integer >= 1 or `None`. The epochs run, of
            `ceil(num_examples / batch_size)` steps each (`fit`'s count, and
            `PoissonSampler`'s), as `calibrate_noise` takes them.

    Returns:
        A float.

    Raises:
        ValueError: For a missing argument, both or neither of `steps` and
            `epochs`, a non-positive noise, a batch larger than the data,
            a `delta` of `1 / num_examples` or more (it would allow
            publishing an example outright), or an unknown accountant or
            sampling.
        ImportError: If `dp-accounting` is not installed.

    Example:

    ```python
    >>> round(epsilon(steps=14062, batch_size=256, num_examples=60000,
    ...               noise_multiplier=1.1, delta=1e-5), 2)
    2.6
    >>> round(epsilon(epochs=60, batch_size=256, num_examples=60000,
    ...               noise_multiplier=1.1, delta=1e-5), 2)
    2.6
    ```
    """
    _check_given(
        batch_size=batch_size,
        num_examples=num_examples,
        noise_multiplier=noise_multiplier,
        delta=delta,
    )
    steps = _steps_of(steps, epochs, batch_size, num_examples, delta)
    _check_accounting(steps, batch_size, num_examples, noise_multiplier, delta)
    _check_choices(accountant, sampling)
    return _spent(
        steps,
        batch_size,  # type: ignore[arg-type]
        num_examples,  # type: ignore[arg-type]
        noise_multiplier,  # type: ignore[arg-type]
        delta,  # type: ignore[arg-type]
        accountant,
        sampling,
    )


def _check_given(**arguments: Any) -> None:
    """Raises a `ValueError` naming the first argument left at `None`."""
    for name, value in arguments.items():
        if value is None:
            raise ValueError(
                f"`{name}` is required. Received: {name}=None. Pass it as "
                "a keyword argument, e.g. epsilon(epochs=20, batch_size=256, "
                "num_examples=60000, noise_multiplier=1.1, delta=1e-5)."
            )


def _steps_of(
    steps: Any, epochs: Any, batch_size: Any, num_examples: Any, delta: Any
) -> int:
    """Returns the steps of a run given in `steps` or in `epochs`.

    Raises:
        ValueError: Unless exactly one of them is given, or for bad values.
    """
    if (epochs is None) == (steps is None):
        raise ValueError(
            "Pass exactly one of `epochs` and `steps`. Received: "
            f"epochs={epochs!r}, steps={steps!r}. Pass for example "
            "epochs=20."
        )
    if steps is not None:
        return steps
    _check_accounting(0, batch_size, num_examples, 1.0, delta)
    epochs = _validation.positive_int("epochs", epochs)
    return epochs * _steps_per_epoch(batch_size, num_examples)


class CalibratedNoise(float):
    """A noise multiplier from `calibrate_noise`, with what it assumed.

    A float (pass it as `noise_multiplier`), that also remembers the run it
    was calibrated for: `DifferentialPrivacyMixin` compares them with what
    `fit` is about to train on, and refuses a run that would spend a budget
    other than the one asked for (Poisson batches calibrated, shuffled
    batches trained; another batch size or data set size). A plain float
    (`float(noise)`) skips that check. A saved model keeps the float only.

    Attributes:
        target_epsilon: Float. The budget of the whole run.
        delta: Float.
        num_examples: Integer. The training set's size.
        batch_size: Integer. The (expected) batch size.
        steps: Integer. The private steps of the run.
        accountant: `"rdp"` or `"pld"`.
        sampling: `"poisson"` or `"shuffle"`.
        num_microbatches: Integer or `None`: the microbatches it was
            calibrated for (`None`: one example each).
    """

    target_epsilon: float
    delta: float
    num_examples: int
    batch_size: int
    steps: int
    accountant: str
    sampling: str
    num_microbatches: int | None = None

    def __new__(cls, value: float, **settings: Any) -> "CalibratedNoise":
        """Returns the float `value` with `settings` as attributes."""
        noise = super().__new__(cls, value)
        for name, setting in settings.items():
            setattr(noise, name, setting)
        return noise

    def __reduce__(self) -> tuple[Any, ...]:
        return (_calibrated, (float(self), dict(vars(self))))

    def describe(self) -> str:
        """Returns the settings it was calibrated for, as arguments."""
        return (
            f"target_epsilon={self.target_epsilon}, delta={self.delta}, "
            f"num_examples={self.num_examples}, batch_size={self.batch_size},"
            f" {self.steps} steps, sampling={self.sampling!r}"
        )


def _calibrated(value: float, settings: dict[str, Any]) -> CalibratedNoise:
    """Rebuilds a `CalibratedNoise` (copies and pickles keep it)."""
    return CalibratedNoise(value, **settings)


class TrainingRun:
    """How `fit` is about to draw its batches, as far as it can be told.

    Attributes:
        sampling: `"poisson"` (a `custom_fit.sampling.PoissonSampler`, or
            data whose `sampling` attribute says so), `"shuffle"` (arrays,
            cut into batches of `batch_size` each epoch), or `None`
            (another data type, that does not say).
        batch_size: Integer or `None` (unknown). The logical batch: with
            gradient accumulation, the batches of one update together.
        num_examples: Integer or `None` (unknown).
        steps: Integer or `None`: the private steps (updates) this `fit`
            runs.
        described: String. How the data was given, for messages.
    """

    def __init__(
        self,
        sampling: str | None,
        batch_size: int | None,
        num_examples: int | None,
        steps: int | None,
        described: str,
    ) -> None:
        self.sampling = sampling
        self.batch_size = batch_size
        self.num_examples = num_examples
        self.steps = steps
        self.described = described


def stated_run(
    run: TrainingRun, budgets: Sequence[Any], accumulation: int
) -> TrainingRun:
    """Returns `run`, with its sampling where a `PrivacyBudget` states it.

    The one door into accounting: where custom_fit sees how the batches
    are drawn (arrays, a `PoissonSampler`, data with a `sampling`
    attribute), a budget's `sampling` must agree with it; where it cannot
    (a generator, a `tf.data` pipeline), a budget's explicit `sampling`
    (with its `batch_size` and `num_examples`) states it, and a budget
    that states nothing is refused, as calibrated noise is (`check_run`).

    Args:
        run: The `TrainingRun` custom_fit sees.
        budgets: The `PrivacyBudget`s among `fit`'s callbacks.
        accumulation: The model's batches per update.

    Returns:
        A `TrainingRun`.

    Raises:
        ValueError: For a budget that states another sampling than the
            data's, or none for data that does not say.
    """
    for budget in budgets:
        stated = budget.stated_sampling
        if run.sampling is not None:
            if stated is not None and stated != run.sampling:
                raise ValueError(
                    f"PrivacyBudget is told sampling={stated!r}, and this "
                    f"fit trains on {run.described}, which are "
                    f"{run.sampling!r} batches: its epsilon would be that "
                    "of another run. Received: "
                    f"sampling={stated!r}. Leave sampling out (it follows "
                    f"the data), or pass sampling={run.sampling!r}."
                )
            continue
        if stated is None:
            raise ValueError(
                "PrivacyBudget cannot tell how this data draws its batches, "
                "and the epsilon depends on it (a generator that samples "
                "with replacement spends more than one that shuffles). "
                f"Received: {run.described}, and sampling=None. State it: "
                "PrivacyBudget(..., sampling='shuffle') for each example "
                "once per pass in batches of batch_size, or "
                "sampling='poisson' for Poisson draws of expected size "
                "batch_size; or train on arrays or a "
                "custom_fit.sampling.PoissonSampler."
            )
        run = TrainingRun(
            stated,
            budget.batch_size * accumulation,
            budget.num_examples,
            run.steps,
            f"{run.described}, stated by PrivacyBudget as {stated!r} "
            f"batches of batch_size={budget.batch_size}",
        )
    return run


def passes_begun(run: TrainingRun | None, steps: int) -> int:
    """Returns the passes over shuffled data that `steps` updates begin.

    Each `fit` begins a pass of its own (Keras shuffles anew), and every
    `ceil(num_examples / batch_size)` updates another: a fit that stops
    within a pass has begun it, and an example may be in one of its steps.

    Args:
        run: The fit's `TrainingRun`, or `None`.
        steps: The private steps (updates) the fit ran.

    Returns:
        An integer >= 0; 0 for a run that is not of shuffled batches.
    """
    if run is None or run.sampling != "shuffle" or steps <= 0:
        return 0
    if not run.batch_size or not run.num_examples:
        return steps  # unknown pass length: one per step, never under
    per_pass = _steps_per_epoch(run.batch_size, run.num_examples)
    return -(-steps // per_pass)


def check_run(
    noise: Any,
    expected_batch_size: float | None,
    run: TrainingRun,
    steps_done: int,
    num_microbatches: int | None = None,
    accumulation: int = 1,
) -> str:
    """Checks that a private run is accounted as its noise assumes.

    Raises when `fit`'s batches are not drawn as the model divides them
    (`expected_batch_size` is for Poisson batches, and Poisson batches need
    it) or as the noise was calibrated (`CalibratedNoise`).

    Args:
        noise: The model's `noise_multiplier`.
        expected_batch_size: The model's `expected_batch_size`.
        run: The `TrainingRun` `fit` is about to make.
        steps_done: The private steps the model ran before this `fit`.
        num_microbatches: The model's `num_microbatches`.
        accumulation: The model's batches per update (its microbatches
            split each of them).

    Returns:
        A warning (a string) when the run goes on past the steps the noise
        was calibrated for, so that it spends more than its target; else
        `""`.

    Raises:
        ValueError: Naming the mismatch and the fix.
    """
    if run.sampling == "poisson" and expected_batch_size != run.batch_size:
        raise ValueError(
            "Poisson-sampled batches of random size must be divided by their "
            "expected size, and accounted as Poisson batches. Received: "
            f"{run.described} of expected size {run.batch_size}, and a model "
            f"with expected_batch_size={expected_batch_size}. Pass "
            f"expected_batch_size={run.batch_size} to the model."
        )
    if run.sampling == "shuffle" and expected_batch_size is not None:
        raise ValueError(
            "`expected_batch_size` is for Poisson-sampled batches "
            "(custom_fit.sampling.PoissonSampler); `fit`'s own batches are "
            "shuffled batches of a fixed size, which PrivacyBudget would "
            "then account as Poisson ones, spending more than it reports. "
            f"Received: {run.described} and expected_batch_size="
            f"{expected_batch_size}. Train on a PoissonSampler, or leave "
            "expected_batch_size out."
        )
    if not isinstance(noise, CalibratedNoise):
        return ""
    _check_calibrated_run(noise, run)
    _check_calibrated_microbatches(noise, run, num_microbatches, accumulation)
    if run.steps is None or steps_done + run.steps <= noise.steps:
        return ""
    return (
        f"This fit runs {run.steps} private steps after {steps_done}: "
        f"{steps_done + run.steps} in all, more than the {noise.steps} the "
        f"noise_multiplier was calibrated for ({noise.describe()}), so the "
        "run spends more than target_epsilon. Fit fewer epochs, calibrate "
        "for the whole run, or stop at the budget with "
        "custom_fit.callbacks.PrivacyBudget(max_epsilon=...)."
    )


def check_accounted_run(
    num_examples: int, batch_size: int, run: TrainingRun
) -> None:
    """Raises if an accountant is told another data set or batch than `run`.

    Args:
        num_examples: The training set's size the accountant is told.
        batch_size: The (logical) batch size it is told.
        run: The `TrainingRun` `fit` is about to make.

    Raises:
        ValueError: Naming the setting that differs; the epsilon would be
            computed for another run than the one trained.
    """
    for name, told, trained in (
        ("num_examples", num_examples, run.num_examples),
        ("batch_size", batch_size, run.batch_size),
    ):
        if trained is not None and told != trained:
            raise ValueError(
                f"PrivacyBudget is told {name}={told}, and this fit trains "
                f"with {name}={trained} ({run.described}): the epsilon it "
                "reports would be that of another run, too low where the "
                "data set is smaller or the batches larger than told. "
                f"Received: {name}={told}. Pass {name}={trained} to "
                "PrivacyBudget."
            )


def _check_calibrated_run(noise: CalibratedNoise, run: TrainingRun) -> None:
    """Raises if `run` draws its batches unlike the noise's calibration."""
    fix = (
        f"Train as calibrated, or calibrate for this run "
        f"(custom_fit.privacy.calibrate_noise(..., sampling="
        f"{run.sampling!r}, batch_size={run.batch_size}, "
        f"num_examples={run.num_examples})). A plain float "
        "(noise_multiplier=float(noise)) skips this check."
    )
    if run.sampling is None:
        raise ValueError(
            "The noise_multiplier was calibrated for "
            f"{noise.sampling!r} batches ({noise.describe()}), and custom_fit "
            "cannot tell how this data draws its batches. Received: "
            f"{run.described}. Train on arrays (shuffled batches) or a "
            "custom_fit.sampling.PoissonSampler, or state the sampling: a "
            "custom_fit.callbacks.PrivacyBudget(..., sampling=...) among "
            "the callbacks, or a `sampling` attribute ('poisson' or "
            "'shuffle') and a `batch_size` on the data. " + fix
        )
    received = {
        "sampling": run.sampling,
        "batch_size": run.batch_size,
        "num_examples": run.num_examples,
    }
    for name, value in received.items():
        if value is not None and value != getattr(noise, name):
            raise ValueError(
                "The noise_multiplier was calibrated for another run than "
                f"this fit's ({noise.describe()}), so{_spent_by(noise, run)} "
                f"the budget asked for was target_epsilon="
                f"{noise.target_epsilon}. Received: {run.described}, "
                f"{name}={value!r} where the calibration has {name}="
                f"{getattr(noise, name)!r}. " + fix
            )


def _check_calibrated_microbatches(
    noise: CalibratedNoise,
    run: TrainingRun,
    num_microbatches: int | None,
    accumulation: int,
) -> None:
    """Raises if the model's microbatches are not those calibrated for."""
    # The microbatches split each batch the step sees, not the update's.
    batch_size = (run.batch_size or noise.batch_size) // accumulation
    calibrated = getattr(noise, "num_microbatches", None)
    trained = microbatch_sensitivity(num_microbatches, batch_size)
    if trained == microbatch_sensitivity(calibrated, noise.batch_size):
        return
    if trained > 1:
        spent = ""
        try:
            value = _spent(
                noise.steps,
                noise.batch_size,
                noise.num_examples,
                float(noise) / trained,
                noise.delta,
                noise.accountant,
                noise.sampling,
            )
            spent = f" (epsilon {value:.3g}, where the target was "
            spent += f"{noise.target_epsilon})"
        except (ImportError, ValueError):
            pass
        raise ValueError(
            "The noise_multiplier was calibrated for one example per "
            f"microbatch, and the model groups them (num_microbatches="
            f"{num_microbatches} for batches of {batch_size}): one example "
            "moves its microbatch's clipped gradient by up to twice the "
            f"clip, so the run would spend more than calibrated{spent}. "
            f"Received: num_microbatches={num_microbatches}. Calibrate "
            "for it: custom_fit.privacy.calibrate_noise(..., "
            f"num_microbatches={num_microbatches})."
        )
    raise ValueError(
        "The noise_multiplier was calibrated for microbatches of several "
        f"examples (num_microbatches={calibrated}), and the model clips "
        "each example: it adds twice the noise its target needs. Received: "
        f"num_microbatches={num_microbatches}. Calibrate without "
        "num_microbatches, or pass the model "
        f"num_microbatches={calibrated}."
    )


def _spent_by(noise: CalibratedNoise, run: TrainingRun) -> str:
    """Says what the calibrated run's steps spend when trained as `run`."""
    batch_size = run.batch_size or noise.batch_size
    num_examples = run.num_examples or noise.num_examples
    try:
        spent = _spent(
            noise.steps,
            batch_size,
            num_examples,
            float(noise),
            noise.delta,
            noise.accountant,
            run.sampling or noise.sampling,
        )
    except (ImportError, ValueError):
        return ""
    return (
        f" trained this way its {noise.steps} steps spend epsilon "
        f"{spent:.3g} at delta={noise.delta}, where"
    )


def calibrate_noise(
    target_epsilon: float,
    delta: float,
    num_examples: int,
    batch_size: int,
    epochs: int | None = None,
    steps: int | None = None,
    accountant: str = "rdp",
    sampling: str = "poisson",
    num_microbatches: int | None = None,
) -> CalibratedNoise:
    """Returns the noise multiplier that spends `target_epsilon`, no more.

    Searches (by bisection) the `noise_multiplier` whose epsilon, as
    `epsilon` computes it for these settings, is at most `target_epsilon`
    and within 0.5% of it. Pass the result to the model:

    ```python
    noise = custom_fit.privacy.calibrate_noise(
        target_epsilon=3.0, delta=1e-5, num_examples=60000, batch_size=256,
        epochs=20)
    model = Net(inputs, outputs, l2_norm_clip=1.0, noise_multiplier=noise,
                expected_batch_size=256)
    ```

    Args:
        target_epsilon: Float > 0. The privacy budget of the whole run.
        delta: Float in (0, 1 / num_examples).
        num_examples: Integer. The training set's size.
        batch_size: Integer. The (expected) batch size.
        epochs: Integer or `None`. The epochs of the run, of
            `ceil(num_examples / batch_size)` steps each (`fit`'s count, and
            `PoissonSampler`'s). Pass `epochs` or `steps`, not both.
        steps: Integer or `None`. The private steps of the run.
        accountant: `"rdp"` or `"pld"`; see `epsilon`.
        sampling: `"poisson"` or `"shuffle"`; see `epsilon`.
        num_microbatches: Integer or `None`. The model's
            `num_microbatches`: with microbatches of several examples (a
            number below `batch_size`), one example moves its microbatch's
            clipped gradient by up to twice the clip, and the noise is
            calibrated for that (twice the multiplier of one example per
            microbatch). `None` (the default): one example per microbatch.

    Returns:
        A `CalibratedNoise`: a float, the noise multiplier, that remembers
        these settings, so that the model refuses a `fit` that draws its
        batches otherwise (see `CalibratedNoise`).

    Raises:
        ValueError: For bad arguments, or a target that no noise between
            `MIN_NOISE` and `MAX_NOISE` meets: the message says the
            smallest epsilon the accountant certifies for these settings,
            and what to change.
        ImportError: If `dp-accounting` is not installed.
    """
    steps = _steps_of(steps, epochs, batch_size, num_examples, delta)
    _check_choices(accountant, sampling)
    _check_accounting(steps, batch_size, num_examples, 1.0, delta)
    sensitivity = microbatch_sensitivity(num_microbatches, batch_size)
    if steps == 0 or not _positive(target_epsilon):
        raise ValueError(
            "`target_epsilon` must be a finite float > 0, for a run of at "
            f"least one step. Received: target_epsilon={target_epsilon!r}, "
            f"steps={steps!r}. Pass for example target_epsilon=3.0."
        )
    target = float(target_epsilon)
    cache: dict[float, float] = {}

    def spent(noise: float) -> float:
        if noise not in cache:
            cache[noise] = _spent(
                steps,
                batch_size,
                num_examples,
                noise / sensitivity,
                delta,
                accountant,
                sampling,
            )
        return cache[noise]

    setting = (
        f"delta={delta}, {steps} steps, batch_size={batch_size} of "
        f"num_examples={num_examples}, accountant={accountant!r}, "
        f"sampling={sampling!r}"
    )
    high = 1.0
    while spent(high) > target:
        if high >= MAX_NOISE:
            raise ValueError(
                f"No noise_multiplier up to {MAX_NOISE:g} spends "
                f"target_epsilon={target} or less ({setting}): at "
                f"{MAX_NOISE:g} the accountant still certifies epsilon "
                f"{spent(high):.4g}, and more noise barely lowers it (its "
                "conversion to (epsilon, delta) has a floor). Received: "
                f"target_epsilon={target}. Ask for an epsilon above "
                f"{spent(high):.3g}, or a larger delta, fewer steps or a "
                "smaller batch_size."
            )
        high = min(high * 2, MAX_NOISE)
    low = high / 2
    while spent(low) <= target:
        if low <= MIN_NOISE:
            raise ValueError(
                f"Even noise_multiplier={MIN_NOISE:g} spends no more than "
                f"target_epsilon={target} ({setting}): the target is too "
                "loose for the noise to be calibrated to it. Received: "
                f"target_epsilon={target}. Ask for a smaller epsilon (DP-"
                "SGD is usually run at epsilon 1 to 10)."
            )
        high, low = low, max(low / 2, MIN_NOISE)
    # Invariant: spent(low) > target >= spent(high).
    while spent(high) < (1 - _CALIBRATION_RTOL) * target and (
        high - low > 1e-9 * high
    ):
        middle = (low + high) / 2
        if spent(middle) > target:
            low = middle
        else:
            high = middle
    return CalibratedNoise(
        high,
        target_epsilon=target,
        delta=delta,
        num_examples=num_examples,
        batch_size=batch_size,
        steps=steps,
        accountant=accountant,
        sampling=sampling,
        num_microbatches=num_microbatches,
    )


def microbatch_sensitivity(
    num_microbatches: int | None, batch_size: int | None
) -> float:
    """Returns how far one example moves its microbatch, in clips: 1 or 2.

    One example per microbatch (`num_microbatches` of `None` or the batch
    size) moves the clipped sum by at most the clip; in a microbatch of
    several examples it moves the microbatch's clipped mean from one point
    of the clip ball to another, up to twice the clip.

    Args:
        num_microbatches: The model's `num_microbatches`, or `None`.
        batch_size: The batch size, or `None` (unknown).

    Returns:
        `1.0` or `2.0`.
    """
    grouped = num_microbatches is not None and num_microbatches != batch_size
    return 2.0 if grouped else 1.0


def _spent(
    steps: int,
    batch_size: int,
    num_examples: int,
    noise_multiplier: float,
    delta: float,
    accountant: str,
    sampling: str,
) -> float:
    """Returns dp-accounting's epsilon for checked arguments."""
    try:
        import dp_accounting
        from dp_accounting import pld
        from dp_accounting import rdp
    except ImportError as error:
        raise ImportError(
            "custom_fit.privacy computes epsilon with Google's "
            "`dp-accounting` package, which is not installed. Install it "
            "with `pip install dp-accounting` or "
            "`pip install 'custom-fit[privacy]'`."
        ) from error
    if steps == 0:
        return 0.0
    gaussian = dp_accounting.GaussianDpEvent(noise_multiplier)
    if sampling == "poisson":
        event = dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                batch_size / num_examples, gaussian
            ),
            steps,
        )
    else:
        epochs = -(-steps // _steps_per_epoch(batch_size, num_examples))
        event = dp_accounting.SelfComposedDpEvent(gaussian, epochs)
    ledger = rdp.RdpAccountant() if accountant == "rdp" else pld.PLDAccountant()
    with _quiet_accountant():
        ledger.compose(event)
        return float(ledger.get_epsilon(delta))


@contextlib.contextmanager
def _quiet_accountant() -> Iterator[None]:
    """Silences dp-accounting's warnings of orders it leaves out.

    Its RDP accountant logs one line per Rényi order whose series does not
    converge and leaves that order out of the minimum (the epsilon stays a
    valid bound): dozens of lines per call, none a problem of the run.
    """
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _steps_per_epoch(batch_size: int, num_examples: int) -> int:
    """Returns `ceil(num_examples / batch_size)`, the steps of an epoch."""
    return -(-num_examples // batch_size)


def _positive(value: Any) -> bool:
    """Returns whether `value` is a finite number > 0 (not a bool)."""
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and math.isfinite(value)
        and value > 0
    )


def _check_choices(accountant: Any, sampling: Any) -> None:
    """Raises a `ValueError` for an unknown accountant or sampling."""
    for name, value, allowed in (
        ("accountant", accountant, ACCOUNTANTS),
        ("sampling", sampling, SAMPLINGS),
    ):
        if value not in allowed:
            raise ValueError(
                f"`{name}` must be one of {allowed}. Received: "
                f"{name}={value!r}. Pass one of the allowed values."
            )


def _check_accounting(
    steps: Any,
    batch_size: Any,
    num_examples: Any,
    noise_multiplier: Any,
    delta: Any,
) -> None:
    """Raises a `ValueError` naming the first bad accounting argument."""
    for name, value, low in (
        ("steps", steps, 0),
        ("batch_size", batch_size, 1),
        ("num_examples", num_examples, 1),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(
                f"`{name}` must be an integer >= {low}. Received: "
                f"{name}={value!r}. Pass a whole number."
            )
    if batch_size > num_examples:
        raise ValueError(
            "`batch_size` cannot exceed `num_examples`. Received: "
            f"batch_size={batch_size}, num_examples={num_examples}. Pass "
            "the size of the whole training set as num_examples."
        )
    if not _positive(noise_multiplier):
        raise ValueError(
            "`noise_multiplier` must be a number > 0 for a finite epsilon. "
            f"Received: noise_multiplier={noise_multiplier!r}. Pass for "
            "example noise_multiplier=1.1."
        )
    if not (isinstance(delta, float) and 0 < delta < 1 / num_examples):
        raise ValueError(
            "`delta` must be a float in (0, 1 / num_examples): a delta of "
            "1 / num_examples or more allows a mechanism that publishes one "
            "example in the clear. Received: "
            f"delta={delta!r} with num_examples={num_examples} (1 / "
            f"num_examples = {1 / num_examples:.3g}). Pass a smaller delta, "
            "such as 1e-5 for 60,000 examples."
        )
