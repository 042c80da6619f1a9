"""`TrainStepMixin`: `train_step` and `test_step` as a pipeline of hooks."""

import warnings
from collections.abc import Sequence
from typing import Any
from typing import TypeVar

import keras
import tensorflow as tf

from custom_fit import _keras_compat
from custom_fit import _options
from custom_fit import _scalar_metrics
from custom_fit import _validation
from custom_fit import accumulation
from custom_fit import clipping
from custom_fit import pipeline
from custom_fit._types import Gradients
from custom_fit._types import Logs
from custom_fit._types import Optimizer
from custom_fit._types import Scalar
from custom_fit._types import StepFunction
from custom_fit._types import Variable

# The models whose train or test function is running, innermost last, with
# the kind of step ("train" or "test"). A module global, not a context
# variable: MirroredStrategy traces each replica in a thread of its own.
_DRIVERS: list[tuple["TrainStepMixin", str]] = []

_Model = TypeVar("_Model", bound="TrainStepMixin")


class TrainStepMixin:
    """Base mixin: Keras' training step, split into overridable hooks.

    Put it (or any custom_fit mixin, which all derive from it) before the
    Keras model class. With no hook overridden, `fit` and `evaluate` give
    the same weights and logs as the plain model. Each step runs:

    ```python
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    with tf.GradientTape() as tape:
        y_pred = self.forward_pass(x, training=True)
        loss = self.compute_loss(x, y, y_pred, sample_weight, training=True)
    self.minimize(loss, tape)  # the gradient pipeline, below
    return self.compute_metrics(x, y, y_pred, sample_weight)

    # minimize(loss, tape, variables, optimizer):
    scaled_loss = optimizer.scale_loss(loss)
    gradients = self.compute_gradients(tape, scaled_loss, variables, optimizer)
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
    the global batch and are the same on every replica.
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
            steps). Defaults to 20; `None` for no limit.
        gradient_accumulation_steps: Integer or `None`. Average the true
            gradients of this many consecutive batches and update once, with
            the average: `transform_gradients` (clipping) and
            `inspect_gradients` run once per update, on the average, never
            per batch. `optimizer.iterations` counts updates. Use it instead
            of the optimizer argument of the same name, which custom_fit
            refuses because it would transform each batch's gradient.
            Defaults to `None` (update at every batch).

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

    skip_nonfinite = _options.Option(False, _validation.boolean)
    max_consecutive_skipped_steps = _options.Option(
        20, _validation.positive_int_or_none
    )
    gradient_accumulation_steps = _options.Option(
        None, _validation.positive_int_or_none
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        _refuse_parameter_server_strategy()
        names = _options.declared_options(type(self))
        options = {name: kwargs.pop(name) for name in names if name in kwargs}
        super().__init__(*args, **kwargs)
        self._configure_options(options)

    def _configure_options(self, options: dict[str, Any]) -> None:
        """Validates and stores `options`, then creates the state they need."""
        _options.store_options(self, options)
        self._warned_about: set[str] = set()
        if "_step_metrics" not in self.__dict__:
            # Kept out of Keras' attribute tracking, which refuses new state
            # on a built model; `metrics` below lists them instead.
            self.__dict__["_step_metrics"] = {}
            # Log key -> kinds of step ("train", "test") that report it.
            self.__dict__["_step_metric_kinds"] = {}
            self.__dict__["_accumulators"] = {}
            self.__dict__["_muted_reports"] = False
        if self.skip_nonfinite and not hasattr(
            self, "_consecutive_skipped_steps"
        ):
            self._consecutive_skipped_steps = tf.Variable(
                0,
                dtype=tf.int64,
                trainable=False,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                name="consecutive_skipped_steps",
            )

    # Hooks, in the order `train_step` calls them.

    def forward_pass(self, x: Any, training: bool) -> Any:
        """Runs the model on `x`. First hook of `train_step` and `test_step`.

        Args:
            x: Input data of the batch.
            training: Bool. `True` in `train_step`, `False` in `test_step`.

        Returns:
            The predictions `y_pred`.
        """
        return _keras_compat.call_model(self, x, training=training)

    def compute_gradients(
        self,
        tape: tf.GradientTape,
        scaled_loss: tf.Tensor,
        variables: Sequence[Variable],
        optimizer: Optimizer | None = None,
    ) -> Gradients:
        """Returns the true gradients. Runs after the loss, inside the step.

        The result is no longer loss-scaled and, under `tf.distribute`, is
        summed across replicas (see `custom_fit.pipeline`).

        Args:
            tape: The `tf.GradientTape` of the forward pass.
            scaled_loss: The loss after `optimizer.scale_loss`.
            variables: The variables to differentiate (by default
                `self.trainable_variables`).
            optimizer: The optimizer of this update (by default
                `self.optimizer`); its loss scale is divided out.

        Returns:
            A list aligned with `variables`.
        """
        return pipeline.compute_true_gradients(
            tape, scaled_loss, variables, optimizer or self.optimizer
        )

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
        finite: tf.Tensor | None = None,
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
            the model's name.
        """
        owners: dict[int, str] = {}
        for layer in self.layers:
            for variable in layer.trainable_variables:
                owners.setdefault(id(variable), layer.name)
        return [owners.get(id(variable), self.name) for variable in variables]

    # The gradient pipeline, public for custom steps.

    def minimize(
        self,
        loss: tf.Tensor,
        tape: tf.GradientTape,
        variables: Sequence[Variable] | None = None,
        optimizer: Optimizer | None = None,
    ) -> tf.Tensor | None:
        """Runs the gradient pipeline of this model for one loss.

        This is the building block of every custom_fit step: from a loss
        recorded on a tape to the optimizer update, through this model's
        hooks and options. `compute_gradients` (true gradients: loss scale
        divided out, summed across replicas), gradient accumulation,
        `transform_gradients` (clipping, your overrides),
        `inspect_gradients`, the non-finite guard (`skip_nonfinite`), then
        `apply_gradients`. `train_step` calls it once; a custom `train_step`
        with several networks calls it once per network, on that network,
        with that network's optimizer:

        ```python
        self.discriminator.minimize(d_loss, d_tape, optimizer=self.d_optimizer)
        ```

        Metrics that the network's hooks report (`grad_norm`, ...) are then
        logged under the network's name, `discriminator_grad_norm`, by the
        model whose `fit` runs, if that model is a custom_fit model.

        Call it inside a training step (in the replica context under
        `tf.distribute`).

        Args:
            loss: Scalar tensor recorded by `tape`, as Keras' losses
                compute it: a mean over this replica's batch which, under
                `tf.distribute`, Keras' loss objects and `compute_loss`
                divide by the replica count. Not loss-scaled: this method
                calls `optimizer.scale_loss` itself.
            tape: The `tf.GradientTape` that recorded `loss` (it may still
                be recording, or have stopped).
            variables: List of the variables to update. Defaults to
                `self.trainable_variables`.
            optimizer: The optimizer to update them with. Defaults to
                `self.optimizer`.

        Returns:
            `None` when the update is applied unconditionally (a
            `LossScaleOptimizer` may still skip it, as in Keras); otherwise
            a boolean scalar tensor, true when this call changed the
            variables (false on a skipped non-finite step, or on a
            micro-batch of gradient accumulation).

        Raises:
            ValueError: If there is no optimizer, or the optimizer has its
                own `gradient_accumulation_steps`.
        """
        return self._minimize(loss, tape, variables, optimizer)[0]

    def _minimize(
        self,
        loss: tf.Tensor,
        tape: tf.GradientTape,
        variables: Sequence[Variable] | None,
        optimizer: Optimizer | None,
    ) -> tuple[tf.Tensor | None, tf.Tensor | None]:
        """`minimize`, also returning whether this batch's loss counts.

        Returns a tuple `(applied, counted)`: `applied` as `minimize`
        returns it; `counted`, with `skip_nonfinite`, a boolean tensor that
        is false when this batch's own gradients are not finite (its loss
        then stays out of the epoch mean), else `None`.
        """
        optimizer = self._checked_optimizer(optimizer)
        if variables is None:
            variables = self.trainable_variables
        variables = list(variables)
        self._warn_about_optimizer_clipping(optimizer)
        with tape:
            scaled_loss = optimizer.scale_loss(loss)
        gradients = self.compute_gradients(
            tape, scaled_loss, variables, optimizer=optimizer
        )
        counted = None
        is_update = None
        if self.gradient_accumulation_steps not in (None, 1):
            if self.skip_nonfinite:
                counted = clipping.all_finite(gradients)
            accumulator = self._accumulator(variables)
            gradients, is_update = accumulator.accumulate(gradients)

        check = self.skip_nonfinite or isinstance(
            optimizer, keras.optimizers.LossScaleOptimizer
        )
        finite = clipping.all_finite(gradients) if check else None
        transformed = self.transform_gradients(gradients, variables)
        if self.skip_nonfinite:
            finite = tf.logical_and(finite, clipping.all_finite(transformed))
            if counted is None:
                counted = finite

        def inspect() -> None:
            self.inspect_gradients(
                gradients, transformed, variables, optimizer=optimizer
            )

        def apply(transformed: Gradients, finite: tf.Tensor | None) -> None:
            self.apply_gradients(
                transformed, variables, finite=finite, optimizer=optimizer
            )

        if is_update is None:
            inspect()
            apply(transformed, finite)
            applied = finite if self.skip_nonfinite else None
        else:
            tf.cond(
                is_update,
                lambda: inspect() or tf.constant(True),
                lambda: tf.constant(False),
            )
            pipeline.run_if(is_update, apply, args=(transformed, finite))
            applied = is_update
            if self.skip_nonfinite:
                applied = tf.logical_and(is_update, finite)
        if self.skip_nonfinite:
            skipped = tf.logical_not(finite)
            if is_update is not None:
                skipped = tf.logical_and(is_update, skipped)
            self._record_skipped_step(skipped, is_update)
        return applied, counted

    def _checked_optimizer(self, optimizer: Optimizer | None) -> Optimizer:
        """Returns the optimizer of an update, refusing unusable ones."""
        optimizer = optimizer or getattr(self, "optimizer", None)
        if optimizer is None:
            raise ValueError(
                "`minimize` needs an optimizer. Received: optimizer=None and "
                f"the model {self.name!r} has none. Compile the model, or "
                "pass optimizer=... to `minimize`."
            )
        inner = getattr(optimizer, "inner_optimizer", optimizer)
        steps = getattr(inner, "gradient_accumulation_steps", None)
        if steps:
            raise ValueError(
                "The optimizer accumulates gradients itself, after "
                "custom_fit's transforms, so clipping and inspection would "
                "act on each micro-batch instead of the accumulated "
                "gradient. Received: optimizer with "
                f"gradient_accumulation_steps={steps}. Remove it from the "
                "optimizer and pass gradient_accumulation_steps="
                f"{steps} to the model's constructor instead."
            )
        return optimizer

    def _accumulator(
        self, variables: Sequence[Variable]
    ) -> accumulation.GradientAccumulator:
        """Returns the gradient accumulator of `variables`, made once."""
        key = tuple(id(variable) for variable in variables)
        if key not in self._accumulators:
            self._accumulators[key] = accumulation.GradientAccumulator(
                variables, self.gradient_accumulation_steps
            )
        return self._accumulators[key]

    # The step.

    def train_step(self, data: Any) -> Logs:
        """Runs one training step: forward pass, loss, `minimize`, metrics.

        Args:
            data: A batch, as produced by the data adapter of `fit`.

        Returns:
            A dict of metric results, as `keras.Model.train_step` returns.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        layer_state = self._layer_state_before_step()
        with tf.GradientTape() as tape:
            y_pred = self.forward_pass(x, training=True)
            loss = _keras_compat.compute_loss(
                self, x, y, y_pred, sample_weight, training=True
            )
        counted = self._minimize_if_trainable(loss, tape)
        self._restore_layer_state_if_skipped(layer_state, counted)
        return self._end_train_step(x, y, y_pred, sample_weight, loss, counted)

    def _layer_state_before_step(
        self,
    ) -> tuple[list[Variable], list[tf.Tensor]] | None:
        """With `skip_nonfinite`, copies the layers' non-trainable state.

        The forward pass updates it in training mode (BatchNormalization's
        moving statistics, dropout's seed); a batch whose gradients are not
        finite would leave NaN statistics behind. Returns `None` without
        `skip_nonfinite`, else `(variables, copies)`.
        """
        if not self.skip_nonfinite:
            return None
        variables = list(self.non_trainable_variables)
        if not variables:
            return None
        copies = [tf.identity(tf.convert_to_tensor(v)) for v in variables]
        return variables, copies

    def _restore_layer_state_if_skipped(
        self,
        layer_state: tuple[list[Variable], list[tf.Tensor]] | None,
        counted: tf.Tensor | None,
    ) -> None:
        """Writes back the copied state when this batch was not `counted`.

        A batch is not counted when its own gradients are not finite, so it
        leaves nothing behind, as if it had not been in the data.
        """
        if layer_state is None or counted is None:
            return
        variables, copies = layer_state
        pipeline.run_if(
            tf.logical_not(counted),
            lambda copies: pipeline.assign_variables(variables, copies),
            args=(copies,),
        )

    def _minimize_if_trainable(
        self, loss: tf.Tensor, tape: tf.GradientTape
    ) -> tf.Tensor | None:
        """Runs `_minimize`; warns as Keras does without trainable weights.

        Returns `counted` (see `_minimize`).
        """
        if not self.trainable_variables:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=3
            )
            return None
        return self._minimize(loss, tape, None, None)[1]

    def _end_train_step(
        self,
        x: Any,
        y: Any,
        y_pred: Any,
        sample_weight: Any,
        loss: tf.Tensor,
        counted: tf.Tensor | None,
    ) -> Logs:
        """Tracks the loss, updates the compiled metrics, returns the logs.

        A batch whose loss is not `counted` (a skipped step) stays out of
        the epoch's mean loss.
        """
        self._track_loss(loss, x, counted)
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return _keras_compat.reducible_logs(self, logs)

    def _record_skipped_step(
        self, skipped: tf.Tensor, is_update: tf.Tensor | None = None
    ) -> None:
        """Counts a skipped step in the metric and the consecutive counter.

        With gradient accumulation, only update steps (`is_update`) change
        the consecutive counter.
        """
        self.report_metric(
            "skipped_steps", tf.cast(skipped, tf.float32), reduction="sum"
        )
        count = self._consecutive_skipped_steps
        limit = self.max_consecutive_skipped_steps
        new_count = tf.where(skipped, count + 1, tf.zeros_like(count))
        if is_update is not None:
            new_count = tf.where(is_update, new_count, count)
        if limit is not None:
            # Past the limit the count stays put until the host reads it, so
            # a streak inside one `steps_per_execution` call is not lost.
            new_count = tf.where(count > limit, count, new_count)
        count.assign(new_count)

    def test_step(self, data: Any) -> Logs:
        """Runs one evaluation step: forward pass, loss, metrics.

        Args:
            data: A batch, as produced by the data adapter of `evaluate`.

        Returns:
            A dict of metric results, without the metrics reported only in
            training (such as `skipped_steps`).
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self.forward_pass(x, training=False)
        loss = _keras_compat.compute_loss(
            self, x, y, y_pred, sample_weight, training=False
        )
        self._track_loss(loss, x)
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return _keras_compat.reducible_logs(self, logs)

    def _track_loss(
        self, loss: tf.Tensor, x: Any, counted: tf.Tensor | None = None
    ) -> None:
        """Updates Keras' `loss` metric and notes that this step logs it."""
        _keras_compat.track_loss(self, loss, x, counted=counted)
        driver, kind = _DRIVERS[-1] if _DRIVERS else (None, None)
        kinds = self._step_metric_kinds.setdefault("loss", set())
        kinds.add((id(driver), kind))

    # Metrics reported from inside the step.

    def report_metric(
        self,
        name: str,
        value: Scalar,
        sample_weight: Scalar | None = None,
        reduction: str = "mean",
    ) -> None:
        """Reports a named scalar from inside a step as a Keras metric.

        Call it from any hook of `train_step` or `test_step` (or from
        `compute_loss`). The metric is created on first use, updated at every
        step, appears in the progress bar and in `History` (as
        `val_<name>` when also reported in `test_step`), and is reset, like
        every Keras metric, at the start of each epoch and of each
        `evaluate()`. A metric reported only in `train_step` does not appear
        in validation logs, and the other way round.

        When this model is a network inside another custom_fit model whose
        `fit` runs (a GAN's discriminator, updated with `minimize`), the log
        key is prefixed with this model's name: `discriminator_grad_norm`.
        The outer model lists such metrics among its own, so Keras logs and
        resets them.

        Args:
            name: String. The log key.
            value: Scalar tensor. This step's value.
            sample_weight: Optional scalar weight of this step's value in the
                epoch mean (Keras weights the loss by the batch size).
            reduction: `"mean"` (weighted running mean over the epoch, each
                replica's value counted with its weight) or `"sum"` (total
                over the epoch's steps; under `tf.distribute` the value must
                be the same on every replica, and is counted once).

        Raises:
            ValueError: If `reduction` is not one of `"mean"` and `"sum"`, if
                `name` is already the name of another metric of the model,
                or if `value` is not a scalar.

        Example:

        ```python
        class Net(custom_fit.TrainStepMixin, keras.Model):
            def compute_loss(self, x, y, y_pred, sample_weight=None,
                             training=True):
                loss = super().compute_loss(
                    x, y, y_pred, sample_weight, training=training)
                self.report_metric("prediction_mean", ops.mean(y_pred))
                return loss
        ```
        """
        if self._muted_reports:
            return
        key = self._log_key(name)
        metric = self._step_metric(key, reduction)
        value = _validation.scalar_tensor(value, "The reported metric", name)
        value = tf.cast(value, tf.float32)
        if reduction == "sum":
            # A Sum metric adds every replica's update: count on one only.
            context = tf.distribute.get_replica_context()
            if context is not None and context.num_replicas_in_sync > 1:
                first = tf.equal(context.replica_id_in_sync_group, 0)
                value = value * tf.cast(first, value.dtype)
        metric.update_state(value, sample_weight=sample_weight)
        driver, kind = _DRIVERS[-1] if _DRIVERS else (None, None)
        self._step_metric_kinds.setdefault(key, set()).add((id(driver), kind))

    def _log_key(self, name: str) -> str:
        """Returns `name`, prefixed when another model drives the step."""
        if _DRIVERS and _DRIVERS[-1][0] is not self:
            return f"{self.name}_{name}"
        return name

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        """The model's metrics, then those of `report_metric`.

        Those of `report_metric` include the ones reported by custom_fit
        networks inside this model (see `minimize`).
        """
        return super().metrics + [
            metric
            for model in [self, *self._inner_step_models()]
            for metric in model._step_metrics.values()
        ]

    def get_metrics_result(self) -> Logs:
        """Returns the metric results, as Keras' `get_metrics_result`.

        Inside a train (test) step, metrics of `report_metric` that only the
        test (train) step reports are left out, so that training logs carry
        no `val_` figure and the other way round. So is Keras' `loss` when
        the model was compiled without a loss and the step does not track
        one (a GAN whose `train_step` reports its own losses).

        Returns:
            A dict of metric name to result.
        """
        logs = super().get_metrics_result()
        if not _DRIVERS or _DRIVERS[-1][0] is not self:
            return logs
        step = (id(self), _DRIVERS[-1][1])
        unreported = {
            key
            for model in [self, *self._inner_step_models()]
            for key, kinds in model._step_metric_kinds.items()
            if step not in kinds
        }
        if getattr(self, "loss", None) is None:
            if step not in self._step_metric_kinds.get("loss", ()):
                unreported.add("loss")
        return {k: v for k, v in logs.items() if k not in unreported}

    def _inner_step_models(self) -> list["TrainStepMixin"]:
        """Returns the custom_fit models nested in this one, depth first."""
        found = []
        pending = list(getattr(self, "layers", []))
        while pending:
            layer = pending.pop(0)
            if isinstance(layer, TrainStepMixin):
                found.append(layer)
            pending.extend(getattr(layer, "layers", []))
        return found

    def _step_metric(self, name: str, reduction: str) -> keras.metrics.Metric:
        """Returns the metric behind `name`, creating it on first use."""
        if reduction not in _REDUCTIONS:
            raise ValueError(
                f"`reduction` must be one of {_REDUCTIONS}. Received: "
                f"reduction={reduction!r} for the metric {name!r}. Pass one "
                "of the allowed values."
            )
        metric = self._step_metrics.get(name)
        if metric is None:
            if name in self.metrics_names:
                raise ValueError(
                    f"The model already has a metric named {name!r}. "
                    f"Received: name={name!r}. Report it under another name."
                )
            metric_class = _METRIC_CLASSES[reduction]
            # Lift the variables out of the traced step; they are created once.
            with tf.init_scope():
                metric = metric_class(name=name)
            self._step_metrics[name] = metric
        elif not isinstance(metric, _METRIC_CLASSES[reduction]):
            raise ValueError(
                f"The metric {name!r} was first reported with another "
                f"reduction. Received: reduction={reduction!r}. Use one "
                "reduction per name."
            )
        return metric

    def _maybe_symbolic_build(
        self, iterator: Any = None, data_batch: Any = None
    ) -> None:
        """Keras' pre-`fit` build, with a MultiWorkerMirroredStrategy fix.

        See `_keras_compat.symbolic_build_batch`. The build traces
        `compute_loss` once, outside any step (in cross-replica context
        under a strategy); `report_metric` is muted meanwhile, as that
        trace is not a step.
        """
        if iterator is not None and (_keras_compat.is_multi_worker(self)):
            data_batch = _keras_compat.symbolic_build_batch(self, iterator)
            iterator = None
        muted = self._muted_reports
        self.__dict__["_muted_reports"] = True
        try:
            return super()._maybe_symbolic_build(
                iterator=iterator, data_batch=data_batch
            )
        finally:
            self.__dict__["_muted_reports"] = muted

    def make_train_function(self, force: bool = False) -> StepFunction:
        """Builds the train function; adds the skipped-step limit check.

        Args:
            force: Bool. Rebuild even if a train function exists.

        Returns:
            The train function.
        """
        if self.train_function is not None and not force:
            return self.train_function
        super().make_train_function(force=force)
        self.train_function = self._with_skipped_step_limit(self.train_function)
        self.train_function = self._driven(self.train_function, "train")
        return self.train_function

    def make_test_function(self, force: bool = False) -> StepFunction:
        """Builds the test function, marking this model as the driver.

        Args:
            force: Bool. Rebuild even if a test function exists.

        Returns:
            The test function.
        """
        if self.test_function is not None and not force:
            return self.test_function
        super().make_test_function(force=force)
        self.test_function = self._driven(self.test_function, "test")
        return self.test_function

    def _driven(self, step_function: StepFunction, kind: str) -> StepFunction:
        """Wraps `step_function` to mark this model as the running driver.

        Networks inside it that report metrics while it runs (and traces)
        prefix them with their names; see `report_metric`.
        """

        def driven_step_function(iterator: Any) -> Logs:
            _DRIVERS.append((self, kind))
            try:
                return step_function(iterator)
            finally:
                _DRIVERS.pop()

        return driven_step_function

    def _with_skipped_step_limit(
        self, train_function: StepFunction
    ) -> StepFunction:
        """Wraps `train_function` to raise once too many steps were skipped.

        The counters of this model and of the custom_fit networks nested in
        it (a GAN's discriminator with `skip_nonfinite=True`) are checked.
        Keras' loop already waits for each call's result, so reading them
        here adds no synchronisation; XLA would drop an in-graph assertion,
        which is why the check lives on the host.
        """
        models = self._skip_limited_models()
        if not models:
            return train_function

        def checked_train_function(iterator: Any) -> Logs:
            logs = train_function(iterator)
            for model in models:
                model._check_skipped_step_limit(model is not self)
            return logs

        return checked_train_function

    def _skip_limited_models(self) -> list["TrainStepMixin"]:
        """Returns this and nested models whose skipped steps are limited."""
        return [
            model
            for model in [self, *self._inner_step_models()]
            if model.skip_nonfinite and model.max_consecutive_skipped_steps
        ]

    def _check_skipped_step_limit(self, nested: bool) -> None:
        """Raises `RuntimeError` when the consecutive-skip limit is passed."""
        limit = self.max_consecutive_skipped_steps
        count = int(self._consecutive_skipped_steps.numpy())
        if count <= limit:
            return
        self._consecutive_skipped_steps.assign(0)
        where = f" of the network {self.name!r}" if nested else ""
        raise RuntimeError(
            f"{count} consecutive training steps{where} had non-finite "
            "gradients (NaN or Inf) and were skipped, more than "
            f"`max_consecutive_skipped_steps={limit}`. Training "
            "stopped. Check the inputs and labels for NaN, lower the "
            "learning rate, or clip gradients; pass a larger "
            "`max_consecutive_skipped_steps` (or None) to allow "
            "longer runs of skipped steps."
        )

    def _warn_about_optimizer_clipping(self, optimizer: Optimizer) -> None:
        """Warns once if the optimizer's own clipping is wrong or redundant."""
        found = pipeline.optimizer_clipping(optimizer)
        twice = self._clips_gradients()
        if not found or not (twice or pipeline.replica_count() > 1):
            return
        self._warn_once(
            "optimizer_clipping",
            f"The optimizer clips gradients itself ({_format(found)})."
            + (
                " custom_fit already clips them, so they are clipped twice."
                if twice
                else ""
            )
            + " Under tf.distribute, Keras' optimizer-level clipping acts on "
            "each replica's share of the gradient, before the replicas are "
            "summed, so it does not clip the gradient of the global batch. "
            "Remove the clipping arguments from the optimizer and pass them "
            "to custom_fit.GradientClippingMixin instead.",
        )

    def _clips_gradients(self) -> bool:
        """Returns whether a mixin clips gradients (see the clipping mixin)."""
        return False

    def _warn_once(self, key: str, message: str) -> None:
        """Emits `message` as a `UserWarning` once per model and `key`."""
        if key in self._warned_about:
            return
        self._warned_about.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)

    # Serialization.

    def get_config(self) -> dict[str, Any]:
        """Returns the model config plus every mixin keyword.

        Returns:
            A dict: the Keras model config, updated with one entry per mixin
            keyword (the constructor argument names).
        """
        config = super().get_config()
        config.update(
            {
                name: getattr(self, name)
                for name in _options.declared_options(type(self))
            }
        )
        return config

    @classmethod
    def from_config(
        cls: type[_Model],
        config: dict[str, Any],
        custom_objects: dict[str, Any] | None = None,
    ) -> _Model:
        """Rebuilds a model from `get_config()`, mixin keywords included.

        Keras' `Sequential.from_config` drops unknown keys, so the mixin
        keywords are taken out, the model is built, and they are applied.

        Args:
            config: Dict returned by `get_config()`.
            custom_objects: Optional dict of custom objects.

        Returns:
            The model.
        """
        config = dict(config)
        names = _options.declared_options(cls)
        options = {name: config.pop(name) for name in names if name in config}
        model = super().from_config(config, custom_objects=custom_objects)
        model._configure_options(options)
        return model


_REDUCTIONS = ("mean", "sum")
_METRIC_CLASSES = {
    "mean": _scalar_metrics.ScalarMean,
    "sum": _scalar_metrics.ScalarSum,
}


def _refuse_parameter_server_strategy() -> None:
    """Raises early under ParameterServerStrategy, which fit cannot use."""
    strategy = tf.distribute.get_strategy()
    if isinstance(strategy, tf.distribute.experimental.ParameterServerStrategy):
        raise ValueError(
            "custom_fit mixins cannot train under ParameterServerStrategy: "
            "Keras 3's TensorFlow trainer has no ClusterCoordinator support, "
            'so `fit` fails there for plain keras.Model as well ("To use '
            "this dataset, you need to pass this dataset to "
            'ClusterCoordinator.create_per_worker_dataset"). Received: '
            f"strategy={type(strategy).__name__}. Use MirroredStrategy or "
            "MultiWorkerMirroredStrategy instead."
        )


def _format(arguments: dict[str, Any]) -> str:
    """Formats a dict as `name=value, ...`."""
    return ", ".join(f"{name}={value}" for name, value in arguments.items())
