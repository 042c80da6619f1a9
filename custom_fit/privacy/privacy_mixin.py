"""`DifferentialPrivacyMixin`: DP-SGD inside `fit`."""

import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from custom_fit import _keras_model
from custom_fit import _model_state
from custom_fit import _options
from custom_fit import _slots
from custom_fit import _validation
from custom_fit import backend
from custom_fit._types import Gradients
from custom_fit._types import Optimizer
from custom_fit._types import Tensor
from custom_fit._types import Variable
from custom_fit.privacy import _canaries
from custom_fit.privacy import _clipped_sums
from custom_fit.privacy import _fit_checks
from custom_fit.privacy import _record
from custom_fit.privacy import accounting
from custom_fit.privacy import auditing
from custom_fit.train_step_mixin import BatchLoss
from custom_fit.train_step_mixin import TrainStepMixin

# The ways to clip each example's gradient (`clipping_method`).
CLIPPING_METHODS = ("auto", "ghost", "vectorized")


def _number(name: str, value: Any, zero_allowed: bool) -> float | None:
    """Validates a required float option (`None`: not given)."""
    if value is None:
        return None
    if zero_allowed and value == 0 and not isinstance(value, bool):
        return 0.0
    try:
        return _validation.positive_float_or_none(name, value)
    except ValueError:
        bound = (
            ">= 0 (0 adds no noise, and so gives no privacy)"
            if zero_allowed
            else "greater than 0"
        )
        raise ValueError(
            f"`{name}` must be a finite float {bound}. Received: "
            f"{name}={_validation.shown(value)}. Pass for example "
            f"{name}={1.1 if zero_allowed else 1.0}."
        ) from None


def _clip(name: str, value: Any) -> float | None:
    """Validates `l2_norm_clip`: a finite float > 0."""
    return _number(name, value, zero_allowed=False)


def _noise(name: str, value: Any) -> float | None:
    """Validates `noise_multiplier`: a finite float >= 0 (0: no noise).

    A `custom_fit.privacy.CalibratedNoise` is kept as it is: `fit` checks
    its run.
    """
    number = _number(name, value, zero_allowed=True)
    return value if isinstance(value, accounting.CalibratedNoise) else number


class DifferentialPrivacyMixin(TrainStepMixin):
    """Differentially private training (DP-SGD) with `fit`.

    Each training step computes the true gradient of every microbatch (one
    example by default, or `num_microbatches` groups of consecutive
    examples, each microbatch's loss the mean of its examples' losses),
    clips each to `l2_norm_clip` in global norm over all trainable
    variables, sums them, adds Gaussian noise of standard deviation
    `noise_multiplier * l2_norm_clip` once per coordinate, and divides by
    the number of microbatches, as TensorFlow Privacy's Keras optimizers do
    (Abadi et al. 2016). That gradient then goes through the rest of the
    pipeline (`transform_gradients`, inspection, the optimizer).

    With one example per microbatch and every trained variable in a
    Dense, EinsumDense, Embedding, Conv1D, Conv2D or Conv3D layer (LoRA
    weights of `enable_lora` included), no per-example gradient is formed
    ("ghost clipping", `custom_fit.ghost`): one forward pass records each
    such layer's inputs and the gradients of the examples' summed loss
    with respect to its outputs, from which each example's gradient norm
    follows, and the clipped sum is the same tensors contracted with the
    clip factors. It gives the same result as per-example gradients at
    about the cost of one ordinary step. Otherwise (another layer with
    weights, microbatches of several examples, a loss added in a layer's
    call, a custom loss function, a supported layer called from code Keras
    did not write) per-microbatch gradients are vectorized
    (`tf.vectorized_map` on TensorFlow, `jax.vmap` on JAX, `torch.vmap`);
    on TensorFlow, a model with an op that cannot be vectorized (dropout's
    random seed, say), and on PyTorch (Keras' channels-last Conv2D, say),
    is differentiated one microbatch after another instead, with a
    one-time warning. `clipping_method` chooses; the
    model's `per_example_clipping` says which path a step takes, and
    `per_example_clipping_reason` why. On the ghost path each example gets
    its own dropout draw (the batch's forward pass). The noise
    comes from a generator in the model's state seeded from the operating
    system's entropy (62 bits or more; never saved, not copied by
    `clone_model`), so that nobody can predict it: whoever could would
    subtract it from the released weights. `noise_seed` makes a run
    reproducible, for tests, and warns: the seed is then as secret as the
    data. Over several processes the seed is process 0's; under
    `tf.distribute` each replica clips its own examples, the clipped sums
    are summed across replicas, and the same noise is added once for the
    global batch (the replicas draw it from the same state); on JAX the
    step sees the global batch.

    A microbatch whose gradient is not finite (a NaN in an example, say)
    contributes zero to the sum and still counts among the microbatches,
    so the noisy gradient stays finite: no decision about the step
    (`skip_nonfinite`'s skip included) depends on one example's data,
    only on the noisy result. Every step runs the mechanism and is
    counted in `private_steps`, skipped updates included.

    Batches drawn by `custom_fit.sampling.PoissonSampler` (what the
    accountant assumes) have random sizes: pass the sampler's `batch_size`
    as `expected_batch_size`, and the noisy sum is divided by that fixed
    number instead of the batch's size (which would tell whether an
    example is in it). A microbatch whose sample weights are all 0 (such
    a batch's padding rows) contributes nothing, not even the gradient of
    `model.losses` that its loss includes.

    With `gradient_accumulation_steps=k`, each batch's microbatches are
    clipped as above and their clipped sums accumulated; the noise is added
    once per update, to the sum over its `k` batches (a logical batch of
    `k` times the batch size), which is then divided by the logical
    batch's microbatch count (or `expected_batch_size`, the logical batch's
    expected size). An example must be in an update at most once: Poisson
    batches come from a `PoissonSampler(..., gradient_accumulation_steps=
    k)`, which deals one draw into the update's `k` batches; shuffled
    batches need passes (and `steps_per_epoch`) of a whole number of
    updates; anything else is refused before the first step, and a
    window an earlier fit left open is dropped. `private_steps` counts
    updates: the mechanism runs once per logical batch, which is what the
    accountant must be told
    (`PrivacyBudget` multiplies its `batch_size` by `k`).

    The logged loss and metrics are those of a forward pass over the whole
    batch. `logs["dp_clipped_fraction"]` is the share of microbatches whose
    gradient was clipped (or zeroed, when not finite). How much privacy a
    run spends is the accountant's business: `custom_fit.privacy.epsilon`
    and `custom_fit.callbacks.PrivacyBudget`; to ask for a target epsilon,
    calibrate the noise with `custom_fit.privacy.calibrate_noise`.

    Before its first step `fit` tries the model on the first batch of its
    data (`stateless_call`s in training mode, the model left as it was):
    where changing one example moves another's output or loss (batch
    statistics, a normalization or a loss over the batch axis), ghost
    clipping is not taken; where the state a training step writes follows
    the data (a BatchNormalization's moving statistics, at any depth) the
    model is refused: use `keras.layers.GroupNormalization` or
    `LayerNormalization`, or freeze the layer. Data that can be read only
    once (a generator) is not tried, and ghost clipping is not taken.
    What the private gradient would leave out is refused when the model is
    built: `RegularizationMixin`'s penalties, an overridden `compute_loss`
    or `regularization_losses`, and `SharpnessAwareMixin`.
    Dynamic loss scaling (`LossScaleOptimizer`, the `mixed_float16`
    policy) is refused too: it lowers its scale when a gradient overflows,
    a decision taken on the data; use `mixed_bfloat16`.

    Args:
        l2_norm_clip: Float > 0. The bound of each microbatch's gradient
            norm. Required.
        noise_multiplier: Float >= 0. The noise's standard deviation as a
            multiple of `l2_norm_clip` (0 adds none: no privacy, for tests).
            Required.
        num_microbatches: Integer or `None`. The number of microbatches per
            batch, which must divide the batch size; `None` (the default)
            makes every example a microbatch.
        noise_seed: Integer >= 0 or `None`. Seed of the noise, for a
            reproducible run (warns: whoever knows it can remove the
            noise). `None` (the default): a secret seed from the operating
            system. Never saved; a run that continues after a given seed's
            updates (a loaded model, `BackupAndRestore`) draws a stream of
            its own, none of the earlier noise.
        expected_batch_size: Float > 0 or `None`. With Poisson-sampled
            batches, their expected size (`PoissonSampler.batch_size`; with
            accumulation, the logical batch's): the noisy sum is divided by
            it. `None` (the default) divides by the
            number of microbatches of each batch. Needs one example per
            microbatch (`num_microbatches=None`).
        clipping_method: String. How each example's gradient is clipped:
            `"auto"` (the default) takes ghost clipping where it applies
            (a layer of another kind whose weights are all its own, such
            as a LayerNormalization, gets per-example gradients of its
            weights alone) and per-example gradients of the whole model
            elsewhere; `"ghost"` asks for ghost
            clipping and refuses a model it cannot handle, naming the
            layer (it also accepts supported layers called from a custom
            layer or model, trusting that code to read their weights only
            through their own calls, on whole batches); `"vectorized"`
            always computes per-example gradients. The result is the same.

    Attributes:
        private_steps: Integer. The private steps run so far (the
            mechanism's invocations: one per update, skipped updates
            included), over every
            `fit` of this model; custom_fit state, not saved with the
            model.
        per_example_clipping: String, `"ghost"` or `"vectorized"`: how the
            next step clips. Decided from the model's layers; the first
            step may revise `"ghost"` to `"vectorized"` when it finds a
            loss added in a layer's call or a custom loss function.
        per_example_clipping_reason: String. Why, naming the layer (or
            the loss) in the way of ghost clipping.

    Example:

    ```python
    class Net(custom_fit.DifferentialPrivacyMixin, keras.Model):
        pass

    inputs = keras.Input((8,))
    model = Net(inputs, keras.layers.Dense(3)(inputs), l2_norm_clip=1.0,
                noise_multiplier=1.1, noise_seed=0)
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    model.per_example_clipping  # "ghost": Dense layers only
    ```

    References:
        - [Abadi et al., 2016](https://arxiv.org/abs/1607.00133), "Deep
          Learning with Differential Privacy".
        - [Li et al., 2022](https://arxiv.org/abs/2110.05679), "Large
          Language Models Can Be Strong Differentially Private Learners"
          (ghost clipping).
    """

    reports = ("dp_clipped_fraction",)

    l2_norm_clip = _options.Option(None, _clip, bound=True, required=True)
    noise_multiplier = _options.Option(None, _noise, required=True)
    num_microbatches = _options.Option(None, _validation.positive_int_or_none)
    noise_seed = _options.Option(None, _validation.seed_or_none, saved=False)
    expected_batch_size = _options.Option(
        None, _validation.positive_float_or_none
    )
    clipping_method = _options.Option(
        "auto", _validation.one_of(CLIPPING_METHODS)
    )
    # Every step the mechanism ran (`private_steps`), skipped ones included.
    _private_step_count = _options.State((), "int32")
    # The noise's generator: secret unless `noise_seed` is given.
    _noise_seeds = _options.Seeds("noise_seed", secret=True)
    # A `CanaryAudit`'s statistics and pending sums, one pair per audit
    # (its canary count known when it is attached).
    _audit_buffers = _slots.Buffers("float32")

    def _configure_options(self, options: dict[str, Any]) -> None:
        """Checks the options.

        The noise's generator and the step count are declared state, made
        before (`Configured._configure_options`).
        """
        super()._configure_options(options)
        if self.per_loss_gradients:
            raise ValueError(
                "DifferentialPrivacyMixin does not combine with "
                "`per_loss_gradients`: each microbatch's gradient is clipped "
                "as one. Received: per_loss_gradients="
                f"{self.per_loss_gradients!r}. Leave `per_loss_gradients` "
                "out."
            )
        if self.expected_batch_size is not None and (
            self.num_microbatches is not None
        ):
            raise ValueError(
                "`expected_batch_size` (Poisson-sampled batches) needs one "
                "example per microbatch: a batch of random size split into "
                "a fixed number of microbatches moves every example when "
                "one is added, so no microbatch's clip bounds one example's "
                "influence. Received: expected_batch_size="
                f"{self.expected_batch_size}, num_microbatches="
                f"{self.num_microbatches}. Leave num_microbatches out."
            )
        if self.clipping_method == "ghost" and (
            self.num_microbatches is not None
        ):
            raise ValueError(
                "`clipping_method='ghost'` clips each example's gradient from "
                "its layers' inputs and output gradients, so it needs one "
                "example per microbatch. Received: clipping_method='ghost', "
                f"num_microbatches={self.num_microbatches}. Leave "
                "num_microbatches out, or use clipping_method='auto'."
            )
        _fit_checks.refuse_what_the_private_gradient_leaves_out(self)
        if self.noise_seed is not None:
            warnings.warn(
                f"noise_seed={self.noise_seed} makes the noise of every "
                "update reproducible: whoever knows the seed can subtract the "
                "noise from the released weights, and the privacy is gone. "
                "Keep the seed as secret as the data, for tests and "
                "reproducible runs only; leave it out for a secret seed drawn "
                "from the operating system (it is never saved with the "
                "model).",
                UserWarning,
                stacklevel=4,
            )

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """Trains the model: `keras.Model.fit`, with the same arguments.

        Before the first step it checks that the batches are drawn as the
        model divides and accounts them: a `PoissonSampler` needs
        `expected_batch_size` equal to its batch size (with
        `gradient_accumulation_steps=k`, its logical batch, and a sampler
        that serves each draw as `k` batches), shuffled batches (arrays)
        need it left out (and, with accumulation, passes of a whole number
        of updates), and a noise from `custom_fit.privacy.calibrate_noise`
        must see the sampling, batch size and data set size it was
        calibrated for, and a `custom_fit.callbacks.PrivacyBudget` among the
        callbacks must be told the data set size and batch size `fit`
        trains with. A fit that runs past the calibrated steps warns. Over
        several processes the noise's secret seed is process 0's. An
        update's window that an earlier `fit` left open is dropped (with a
        warning): its batches were never released. A run that continues
        an earlier one (a loaded model, `BackupAndRestore`) with a given
        `noise_seed` or sampler seed draws no noise or batch of that run
        again (see `noise_seed`).

        Returns:
            A `History` object, as `keras.Model.fit` returns.

        Raises:
            ValueError: When the run would not be the one accounted.
        """
        arguments = _keras_model.fit_arguments(self, args, kwargs)
        run, budgets = _fit_checks.accounted_run(self, arguments)
        audit = auditing.audit_of_fit(self, arguments)
        with auditing.feeding(audit, self) as slot:
            return _fit_checks.checked_fit(
                self, super().fit, arguments, run, budgets, slot
            )

    def train_on_batch(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: a private model trains with `fit`.

        `fit` checks the run against the accountant before its first step
        (the sampling, the accumulation windows, the model on its first
        batch, the noise's secret seed over processes); a batch given by
        hand passes none of those checks, and no accountant sees it.

        Raises:
            ValueError: Always.
        """
        raise ValueError(
            "DifferentialPrivacyMixin trains with `fit`, which checks the "
            "run against the accountant before its first step (how the "
            "batches are drawn, the model's examples kept apart, the "
            "noise's seed) and counts every private step; a batch given by "
            "hand passes none of those checks. Received: a call of "
            "train_on_batch. Call fit(x, y, batch_size=..., epochs=1) (or "
            "fit on a PoissonSampler)."
        )

    @property
    def private_steps(self) -> int:
        """The private steps run so far, skipped updates included."""
        return int(backend.current().host_value(self, self._private_step_count))

    @property
    def per_example_clipping(self) -> str:
        """How the next step clips: `"ghost"` or `"vectorized"`."""
        return _clipped_sums.clipping_choice(
            self, _clipped_sums.clipped_variables(self)
        )[0]

    @property
    def per_example_clipping_reason(self) -> str:
        """Why `per_example_clipping` is what it is, naming the layer."""
        return _clipped_sums.clipping_choice(
            self, _clipped_sums.clipped_variables(self)
        )[1]

    def compute_gradients(
        self,
        loss_function: Callable[[], tuple[Tensor, Any]],
        variables: Sequence[Variable] | None,
        optimizer: Optimizer | None = None,
    ) -> tuple[Tensor, Any, Gradients]:
        """Returns the batch's loss and output, and its clipped sum.

        The loss and `y_pred` of a forward pass over the whole batch are
        what the step logs; the gradient is the sum over the batch's
        microbatches of each one's true gradient clipped to
        `l2_norm_clip` (summed across replicas), which
        `finalize_gradients` noises and divides once per update. The rest
        of the step (accumulation, the guard, the update) is
        `TrainStepMixin`'s.

        Args:
            loss_function: The step's `BatchLoss`: the examples come from
                it.
            variables: The variables to differentiate, or `None` for the
                model's trainable variables.
            optimizer: The optimizer of this update.

        Returns:
            A tuple `(loss, y_pred, sums)`; variables Keras overwrites with
            their gradient (float8 state) get `None`: no private value.

        Raises:
            ValueError: For a loss function without its batch (`minimize`
                with a plain function), a layer that mixes examples, or
                dynamic loss scaling.
        """
        if not isinstance(loss_function, BatchLoss):
            raise ValueError(
                "DifferentialPrivacyMixin clips the gradient of each example, "
                "so it needs the batch's examples, which `fit`'s training "
                "step gives it. Received: a loss function without its batch "
                "(`minimize` called with a function). Train the private "
                "model with `fit`, or pass a `custom_fit.BatchLoss`."
            )
        optimizer = optimizer or self.optimizer
        _fit_checks.refuse_batch_mixing(self)
        _fit_checks.refuse_dynamic_loss_scale(optimizer)
        if variables is None:
            variables = self.trainable_variables
        return _clipped_sums.step_sums(
            self, loss_function, variables, optimizer
        )

    def finalize_gradients(
        self,
        gradients: Gradients,
        variables: Sequence[Variable],
        is_update: Tensor | None = None,
    ) -> Gradients:
        """Returns the private gradient: the clipped sums, noised, divided.

        Gaussian noise of standard deviation `noise_multiplier *
        l2_norm_clip` is added once per update (with accumulation, to the
        sum over the update's micro-batches: once per logical batch), then
        the sum is divided by the number of microbatches of the update (or
        by `expected_batch_size`). The update is counted in
        `private_steps`.

        Args:
            gradients: The clipped sums (with accumulation, their mean over
                the micro-batches so far).
            variables: The variables.
            is_update: As in `TrainStepMixin.finalize_gradients`.

        Returns:
            The private gradients, aligned with `variables`.
        """
        state = _model_state.state_of(self)
        steps = self.gradient_accumulation_steps or 1
        sums = [None if g is None else g * steps for g in gradients]
        slot = _clipped_sums.audit_slot_sums(self, is_update)
        if self.noise_multiplier:
            seeds = self._noise_seeds
            before = backend.current().read(seeds.state)
            clip = ops.cast(self.l2_norm_clip, "float32")
            present = [g for g in sums if g is not None]
            if slot is not None:
                # An audit's slot is noised with the rest, in the same call.
                present.append(slot[0])
            noisy = iter(
                accounting.add_noise(
                    present,
                    ops.cast(self.noise_multiplier, "float32") * clip,
                    seeds,
                )
            )
            sums = [None if g is None else next(noisy) for g in sums]
            if slot is not None:
                _clipped_sums.record_audit(
                    self, next(noisy), slot[1], is_update
                )
            if is_update is not None:
                # The generator moves on once per update, not per batch.
                backend.current().restore_if(
                    ops.logical_not(is_update), [seeds.state], [before]
                )
        if self.expected_batch_size is not None:
            count: Any = ops.cast(self.expected_batch_size, "float32")
        else:
            count = state.local.dp_microbatches * steps
        # The mechanism runs once per update, whatever becomes of it.
        counter = self._private_step_count
        current = backend.current().read(counter)
        counter.assign(
            current + 1
            if is_update is None
            else ops.where(is_update, current + 1, current)
        )
        return [
            None if g is None else ops.cast(g / count, v.dtype)
            for g, v in zip(sums, variables)
        ]

    def train_step(self, data: Any) -> Any:
        """Runs one training step (see `TrainStepMixin.train_step`).

        In a fit audited by `auditing.CanaryAudit`, the batch's canary
        rows are told apart by their sample weights first: they reach the
        model's loss with weight 0, and their gradients only the audit's
        slot (`custom_fit.privacy._canaries`).
        """
        state = _model_state.state_of(self)
        if _record.of(self).audit is not None:
            x, y, weights = keras.utils.unpack_x_y_sample_weight(data)
            state.local.audit_rows, weights = _canaries.decode(weights)
            data = (x, y, weights)
        return super().train_step(data)
