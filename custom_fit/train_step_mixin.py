"""`TrainStepMixin`: `train_step` and `test_step` as a pipeline of hooks."""

from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import TypeVar

from custom_fit import _configuring
from custom_fit import _figures
from custom_fit import _gradient_ops
from custom_fit import _keras_compat
from custom_fit import _keras_model
from custom_fit import _layer_groups
from custom_fit import _options
from custom_fit import _per_loss
from custom_fit import _reporting
from custom_fit import _slots
from custom_fit import _step_checks
from custom_fit import _steps
from custom_fit import _update
from custom_fit import _validation
from custom_fit import backend
from custom_fit import pipeline
from custom_fit._types import Gradients
from custom_fit._types import Optimizer
from custom_fit._types import Tensor
from custom_fit._types import Variable

# `BatchLoss` is imported from here too (it was defined here first).
from custom_fit._update import BatchLoss as BatchLoss

_Model = TypeVar("_Model", bound="TrainStepMixin")

# Values of `per_loss_gradients`.
PER_LOSS_MODES = (False, "outputs", "outputs_and_penalties")


if TYPE_CHECKING:
    _TrainerHooks = object
else:
    # Keras trainer methods the backend in use overrides (JAX's
    # `jax_state_sync`); see `custom_fit.backend`.
    _TrainerHooks = backend.trainer_hooks()


class TrainStepMixin(
    _steps.Steps,
    _configuring.Configured,
    _keras_model.KerasModel,
    _keras_compat.PrivateOverrides,
    _update.Minimizing,
    _figures.SharedFigures,
    _reporting.Reporting,
    _TrainerHooks,
):
    """Base mixin: Keras' training step, split into overridable hooks.

    Put it (or any custom_fit mixin, which all derive from it) before the
    Keras model class. With no hook overridden, `fit` and `evaluate` give
    the same weights and logs as the plain model, on TensorFlow and on JAX
    (the backend Keras uses). Each step runs:

    ```python
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

    def loss_function():
        y_pred = self.forward_pass(x, training=True)
        loss = self.compute_loss(x, y, y_pred, sample_weight, training=True)
        return loss, y_pred

    _, y_pred = self.minimize(loss_function, has_aux=True)  # below
    return self.compute_metrics(x, y, y_pred, sample_weight)

    # minimize(loss_function, variables, optimizer):
    loss, y_pred, gradients = self.compute_gradients(
        loss_function, variables, optimizer)  # true gradients
    # (averaged over micro-batches with gradient_accumulation_steps)
    transformed = self.transform_gradients(gradients, variables)
    self.inspect_gradients(gradients, transformed, variables, optimizer)
    self.apply_gradients(transformed, variables, finite, optimizer)
    ```

    `minimize` is public: a custom `train_step` with several networks and
    optimizers (a GAN) calls it once per network, and each network's own
    options and hooks (clipping, inspection, the non-finite guard) apply to
    its update.

    `compute_gradients` returns the *true* gradients: the loss scale of
    mixed precision is divided out, and under `tf.distribute` they are
    summed across replicas, so they equal the single-device gradients of
    the global batch and are the same on every replica (on JAX, a step
    under `keras.distribution` is traced over the global batch).
    `transform_gradients` (clipping, your own changes) therefore acts on
    true gradients, and `apply_gradients` hands them to the optimizer so
    that it neither unscales nor sums them a second time.

    Mixins chain through `transform_gradients`: each applies its transform
    and passes the result to `super()`, so they run left to right in the
    class statement. An override in your class body runs around all of
    them: code before its `super()` call sees the true gradients, code
    after it sees the output of every mixin.

    Args:
        skip_nonfinite: Bool. If `True`, a step whose gradients (true or
            transformed) hold NaN or Inf changes no weight, no optimizer
            variable (slots, iteration count) and no layer state (batch
            normalization statistics); `logs["skipped_steps"]` counts such
            steps per epoch and training goes on. The decision
            is taken on the summed gradients, so all replicas agree.
            Defaults to `False` (Keras behaviour: the update is applied).
        max_consecutive_skipped_steps: Integer or `None`. With
            `skip_nonfinite=True`, the number of consecutive skipped steps
            after which training stops with a `RuntimeError`. Checked after
            each call of the train function (every `steps_per_execution`
            steps). Defaults to 20; `None` for no limit. Skipped spikes
            count too.
        skip_gradient_norm_above: Float, schedule or `None`. With
            `skip_nonfinite=True`, a step whose true global gradient norm
            (before any transform; with accumulation, of the averaged
            gradient of the update) exceeds it is skipped as a non-finite
            one is: nothing changes, and `logs["skipped_spikes"]` counts
            it besides `skipped_steps`. Defaults to `None` (off).
        skip_gradient_norm_ratio_above: Float greater than 1, schedule or
            `None`. With `skip_nonfinite=True`, a step whose true global
            gradient norm exceeds this many times the running average of
            the norms of the updates applied so far is skipped (a spike).
            The average is an exponential moving average kept in the
            model's state (bias-corrected, updated only by applied
            updates); the rule applies once `gradient_norm_warmup_steps`
            updates were applied. Defaults to `None` (off).
        gradient_norm_average_decay: Float in (0, 1). The decay of that
            running average. Defaults to 0.99.
        gradient_norm_warmup_steps: Integer. Applied updates before the
            relative rule applies. Defaults to 20.
        layer_depth: Integer or `None`. How deep layers nest in the groups
            of inspection and of `layer_clipnorm`/`clip_layers`. `None`
            (the default): a group is a layer, never a model; a model used
            as a layer (the model you wrapped, `Net(inputs,
            base(inputs))`, a keras-hub task's backbone, a `Sequential`
            encoder) is split into its layers at any depth, named by their
            path (`"encoder/dense_1"`; `clip_layers=["encoder"]` selects
            them all). 1 groups by the entries of `model.layers` (a nested
            model is one group); 2 splits a model used as a layer into its
            own layers, and so on. Needs inspection or layer-wise clipping.
        per_loss_gradients: `False`, `"outputs"` or
            `"outputs_and_penalties"`. With `"outputs"`, the compiled loss
            of each output of the model is differentiated on its own (one
            backward pass per loss), and `combine_gradients` receives one
            list of true gradients per loss, by output name, plus the rest
            of the loss (`model.losses`, `RegularizationMixin` penalties)
            under `"regularization"`; with `"outputs_and_penalties"` each
            named penalty is a loss of its own too. Defaults to `False`
            (one backward pass of the total loss).
        gradient_accumulation_steps: Integer or `None`. Average the true
            gradients of this many consecutive batches and update once, with
            the average: `transform_gradients` (clipping) and
            `inspect_gradients` run once per update, on the average, never
            per batch. `optimizer.iterations` counts updates. Use it instead
            of the optimizer argument of the same name, which custom_fit
            refuses because it would transform each batch's gradient.
            Defaults to `None` (update at every batch).
        progress_bar_logs: `None`, `"all"` or a list of log names and
            `fnmatch` patterns: the logs `fit`'s progress bar shows (a
            name shows its `val_` twin too). History, `evaluate` and every
            callback receive all logs whatever it says. Defaults to `None`:
            every log but the per-layer figures (`grad_norm/<layer>` of
            `layer_norms_in_logs`), which would add a column per layer.

    Example:
    ```python
    class Net(custom_fit.TrainStepMixin, keras.Model):
        def transform_gradients(self, gradients, variables):
            gradients = super().transform_gradients(gradients, variables)
            return [None if g is None else 0.5 * g for g in gradients]

    inputs = keras.Input((4,))
    model = Net(inputs, keras.layers.Dense(1)(inputs), skip_nonfinite=True)
    model.compile(optimizer="sgd", loss="mse")
    ```
    """

    # Metric names the mixin reports (see `_options.declared_reports`).
    reports: tuple[str, ...] = (
        "skipped_steps",
        "skipped_spikes",
        "skip_gradient_norm_above",
        "skip_gradient_norm_ratio_above",
    )
    # Whether the mixin groups gradients by layer on its own (inspection).
    groups_by_layer = False

    skip_nonfinite = _options.Option(False, _validation.boolean)
    max_consecutive_skipped_steps = _options.Option(
        20, _validation.positive_int_or_none, requires=("skip_nonfinite",)
    )
    skip_gradient_norm_above = _options.Option(
        None,
        _validation.positive_float_or_none,
        requires=("skip_nonfinite",),
        bound=True,
        schedulable=True,
    )
    skip_gradient_norm_ratio_above = _options.Option(
        None,
        _validation.float_above_one_or_none,
        requires=("skip_nonfinite",),
        schedulable=True,
    )
    gradient_norm_average_decay = _options.Option(
        0.99, _validation.fraction, requires=("skip_gradient_norm_ratio_above",)
    )
    gradient_norm_warmup_steps = _options.Option(
        20,
        _validation.positive_int,
        requires=("skip_gradient_norm_ratio_above",),
    )
    gradient_accumulation_steps = _options.Option(
        None, _validation.positive_int_or_none
    )
    per_loss_gradients = _options.Option(
        False, _validation.one_of(PER_LOSS_MODES)
    )
    progress_bar_logs = _options.Option(None, _validation.logs_selection)
    layer_depth = _options.Option(
        None,
        _validation.positive_int_or_none,
        requires=("layer_clipnorm", "clip_layers", "no_clip_layers"),
        or_capability="groups_by_layer",
        former_defaults=(1,),  # until layer_depth=None split nested models
    )

    # The guard's state (`_guard.Guard`): the skipped steps in a row, and
    # the running average of the gradient norm that spikes are told by.
    _consecutive_skipped_steps = _options.State(
        (), "int32", requires=("skip_nonfinite",)
    )
    _gradient_norm_average = _options.State(
        (), "float32", requires=("skip_gradient_norm_ratio_above",)
    )
    _gradient_norm_count = _options.State(
        (), "int32", requires=("skip_gradient_norm_ratio_above",)
    )
    # Accumulation's running sums and count of calls, per set of variables
    # (`accumulation.GradientAccumulator`).
    _gradient_sums = _slots.Slots(requires=("gradient_accumulation_steps",))
    _accumulation_counts = _slots.Buffers(
        "int32", requires=("gradient_accumulation_steps",)
    )

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Checks the order of the bases; lists the options in a signature.

        Raises:
            TypeError: If a Keras class comes before the custom_fit mixins,
                or an option has the name of a Keras attribute.
        """
        super().__init_subclass__(**kwargs)
        _step_checks.refuse_keras_before_mixins(cls, TrainStepMixin)
        _step_checks.refuse_options_hiding_keras(cls)
        _step_checks.check_declared_options(cls)
        for kind in ("train_step", "test_step"):
            step = vars(cls).get(kind)
            if step is not None and not hasattr(step, "custom_fit_checked"):
                setattr(cls, kind, _step_checks.checked_step(step, kind))
        cls.__signature__ = _options.signature(cls)

    # Hooks, in the order `train_step` calls them.

    def forward_pass(self, x: Any, training: bool) -> Any:
        """Runs the model on `x`. First hook of `train_step` and `test_step`.

        Args:
            x: Input data of the batch.
            training: Bool. `True` in `train_step`, `False` in `test_step`.

        Returns:
            The predictions `y_pred`.
        """
        # Compiled on PyTorch with `jit_compile=True` (elsewhere the whole
        # step is).
        return backend.current().forward(
            self, _keras_compat.call_model, x, training
        )

    def compute_gradients(
        self,
        loss_function: Callable[[], tuple[Tensor, Any]],
        variables: Sequence[Variable] | None,
        optimizer: Optimizer | None = None,
    ) -> tuple[Tensor, Any, Gradients]:
        """Returns the loss and the true gradients. First hook of `minimize`.

        Differentiates `optimizer.scale_loss(loss)` with respect to
        `variables`, then divides the loss scale out and, under
        `tf.distribute`, sums across replicas (see `custom_fit.pipeline`).
        Override it to compute gradients another way, returning true
        gradients.

        Args:
            loss_function: Callable of no arguments returning `(loss, aux)`:
                the scalar loss (not loss-scaled) and any other output of
                the forward pass (`y_pred` in `train_step`).
            variables: The variables to differentiate, or `None` for the
                model's trainable variables as they are after
                `loss_function` ran (it may build the model).
            optimizer: The optimizer of this update (by default
                `self.optimizer`); its loss scale is divided out.

        Returns:
            A tuple `(loss, aux, gradients)`: the loss, the aux output, and
            the true gradients, a list aligned with `variables`.
        """
        optimizer = optimizer or self.optimizer
        targets: Any = variables
        if targets is None:
            targets = lambda: self.trainable_variables  # noqa: E731
        if self.per_loss_gradients:
            return _per_loss.gradients(self, loss_function, targets, optimizer)

        def scaled() -> tuple[Tensor, tuple[Tensor, Any]]:
            loss, aux = loss_function()
            return optimizer.scale_loss(loss), (loss, aux)

        _, (loss, aux), gradients = backend.current().value_and_grad(
            scaled, targets
        )
        if callable(targets):
            targets = targets()
        return (
            loss,
            aux,
            pipeline.true_gradients(gradients, targets, optimizer),
        )

    def combine_gradients(
        self,
        gradients_by_loss: dict[str, Gradients],
        variables: Sequence[Variable],
    ) -> Gradients:
        """Returns the gradients to apply, from one list per loss.

        Runs in `compute_gradients` with `per_loss_gradients` set, before
        `transform_gradients`: each list is the true gradient of one loss
        (an output's compiled loss, a penalty, or `"regularization"` for
        the rest). This base implementation returns their sum, the
        gradient of the total loss. Override it (calling `super()` or not)
        to balance tasks; `PCGradMixin` projects conflicting ones.

        Args:
            gradients_by_loss: Dict of loss name to a list of true
                gradients aligned with `variables` (`None` where a loss does
                not depend on a variable).
            variables: The variables.

        Returns:
            A list of gradients aligned with `variables`.
        """
        del variables
        lists = list(gradients_by_loss.values())
        combined: Gradients = []
        for column in zip(*lists):
            present = [_gradient_ops.dense(g) for g in column if g is not None]
            combined.append(_gradient_ops.add_all(present) if present else None)
        return combined

    def finalize_gradients(
        self,
        gradients: Gradients,
        variables: Sequence[Variable],
        is_update: Tensor | None = None,
    ) -> Gradients:
        """Returns the gradients of an update. Runs before the transforms.

        Called once per step, after gradient accumulation (with the mean of
        the update's micro-batches) and before `transform_gradients`; this
        base implementation returns them unchanged.
        `DifferentialPrivacyMixin` adds its noise here, once per update.

        Args:
            gradients: List aligned with `variables`: the true gradients
                (with accumulation, their running mean).
            variables: The variables.
            is_update: `None` without accumulation; else a boolean scalar
                tensor, true on the steps that update (the others' result
                is not used).

        Returns:
            A list aligned with `variables`.
        """
        del variables, is_update
        return gradients

    def transform_gradients(
        self, gradients: Gradients, variables: Sequence[Variable]
    ) -> Gradients:
        """Returns modified gradients. Runs after `compute_gradients`.

        The gradients received are true: not loss-scaled and already summed
        across replicas. Override it, calling `super()`, to change them;
        this base implementation returns them unchanged.

        Args:
            gradients: List aligned with `variables`: tensors,
                `tf.IndexedSlices` or `None`.
            variables: The variables the gradients belong to.

        Returns:
            A list of the same length as `variables`.
        """
        del variables
        return gradients

    def apply_gradients(
        self,
        gradients: Gradients,
        variables: Sequence[Variable],
        finite: Tensor | None = None,
        optimizer: Optimizer | None = None,
    ) -> None:
        """Updates the variables. Runs after `transform_gradients`.

        The gradients received are true (not loss-scaled, summed across
        replicas); see `custom_fit.pipeline.apply_true_gradients`. With
        `gradient_accumulation_steps`, it runs only on update steps.

        Args:
            gradients: List aligned with `variables`.
            variables: The variables to update.
            finite: Boolean scalar tensor or `None`. When given and `False`,
                the step is skipped.
            optimizer: The optimizer of this update (by default
                `self.optimizer`).
        """
        pipeline.apply_true_gradients(
            optimizer or self.optimizer, gradients, variables, finite=finite
        )

    def inspect_gradients(
        self,
        gradients: Gradients,
        transformed_gradients: Gradients,
        variables: Sequence[Variable],
        optimizer: Optimizer | None = None,
    ) -> None:
        """Looks at the gradients. Runs after `transform_gradients`.

        Called before `apply_gradients`, whatever the order of the mixins,
        with both the true gradients (not loss-scaled, summed across
        replicas, not yet transformed) and the transformed ones. It must not
        change them; this base implementation does nothing. With
        `gradient_accumulation_steps`, it runs only on update steps, with
        the averaged gradients.

        Args:
            gradients: The true gradients, aligned with `variables`.
            transformed_gradients: The output of `transform_gradients`.
            variables: The variables the gradients belong to.
            optimizer: The optimizer of this update (by default
                `self.optimizer`).
        """
        del gradients, transformed_gradients, variables, optimizer

    def layer_names_of(self, variables: Sequence[Variable]) -> list[str]:
        """Returns, for each variable, the name of its entry in `self.layers`.

        Args:
            variables: List of variables of the model.

        Returns:
            A list of layer names aligned with `variables`. A variable that
            no entry of `self.layers` owns (created by the model itself) gets
            the model's name. With `layer_depth=2` (or more), a model used
            as a layer (a `keras.Sequential` encoder) is split into its own
            layers, named by their path: `"encoder/dense_1"`; with
            `layer_depth=None` (the default), every model at any depth.
        """
        return _layer_groups.layer_names(self, variables, self.layer_depth)
