"""`TrainStepMixin`: `train_step` and `test_step` as a pipeline of hooks."""

import inspect
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import TYPE_CHECKING
from typing import Any
from typing import TypeVar

import keras
from keras import ops

from custom_fit import _figures
from custom_fit import _gradient_ops
from custom_fit import _guard
from custom_fit import _keras_compat
from custom_fit import _keras_model
from custom_fit import _layer_groups
from custom_fit import _model_state
from custom_fit import _options
from custom_fit import _per_loss
from custom_fit import _step_checks
from custom_fit import _update
from custom_fit import _validation
from custom_fit import backend
from custom_fit import pipeline
from custom_fit._types import Gradients
from custom_fit._types import Logs
from custom_fit._types import Optimizer
from custom_fit._types import Scalar
from custom_fit._types import Tensor
from custom_fit._types import Variable
from custom_fit._update import BatchLoss

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
    _keras_model.KerasModel, _keras_compat.PrivateOverrides, _TrainerHooks
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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._check_model()
        options = _options.pop_options(type(self), kwargs)
        _options.refuse_unknown_keywords(type(self), args, kwargs)
        source = _keras_compat.model_being_cloned()
        super().__init__(*args, **kwargs)
        if not options:
            # From `from_config`: the options Keras does not pass on.
            options = _options.take_pending(type(self)) or {}
        if not options and isinstance(source, TrainStepMixin):
            # keras.models.clone_model builds the clone without keywords;
            # the secret options (a seed) are not copied, as not saved.
            saved = _options.saved_options(type(source))
            options = {
                name: value
                for name, value in _model_state.state_of(source).options.items()
                if name in saved
            }
        self._configure_options(options)

    def _check_model(self) -> None:
        """Raises for a backend, step override or strategy it refuses."""
        backend.check_supported()
        _step_checks.refuse_stateless_step_overrides(type(self), TrainStepMixin)
        backend.current().check_strategy()

    def _configure_if_needed(self) -> None:
        """Configures the default options of a model built without them.

        A class that mixes the trainer into a `keras.layers.Layer` may call
        the `__init__` of its Keras bases directly (as Keras' own trainer
        tests do), so that `TrainStepMixin.__init__` never ran.
        """
        if _model_state.state_of(self).guard is None:
            self._check_model()
            self._configure_options({})

    def _configure_options(self, options: dict[str, Any]) -> None:
        """Validates and stores `options`, then creates the state they need."""
        dtype = keras.backend.standardize_dtype(
            self.dtype_policy.variable_dtype
        )
        _options.store_options(self, options, dtype)
        _options.make_states(self)
        state = _model_state.state_of(self)
        state.guard = _guard.Guard(self)

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

    # The gradient pipeline, public for custom steps.

    def minimize(
        self,
        loss: Tensor | Callable[[], Tensor],
        tape: Any = None,
        variables: Sequence[Variable] | None = None,
        optimizer: Optimizer | None = None,
        *,
        penalty_inputs: Any = None,
        has_aux: bool = False,
    ) -> Any:
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
        def discriminator_loss():
            ...  # forward passes, written with keras.ops
            return d_loss

        self.discriminator.minimize(
            discriminator_loss, optimizer=self.d_optimizer
        )
        ```

        The loss is given as a function of no arguments, which `minimize`
        differentiates with respect to `variables`; on TensorFlow it may
        also be a loss already recorded on a tape,
        `minimize(d_loss, d_tape, ...)`.

        What else the loss function computed comes back with
        `has_aux=True`: the function returns `(loss, aux)`, `aux` any
        nested structure of tensors (the student's predictions, for the
        compiled metrics), and `minimize` returns `(applied, aux)`:

        ```python
        def student_loss():
            y_pred = self.student(x, training=True)
            return self.compute_loss(x, y, y_pred), y_pred

        _, y_pred = self.student.minimize(student_loss, has_aux=True)
        ```

        Take values out of the loss function this way, not through a
        variable of an enclosing function: on JAX the loss function runs
        inside `jax.value_and_grad`, and a value it leaves behind cannot
        be used after it (`UnexpectedTracerError`). `aux` holds the values
        of the forward pass, with no gradient attached (the same on every
        backend): differentiate a value again by computing it in the next
        loss function.

        Metrics that the network's hooks report (`grad_norm`, ...) are then
        logged under the network's name, `discriminator_grad_norm`, by the
        model whose `fit` runs, if that model is a custom_fit model.

        A network with `RegularizationMixin` options gets its penalties
        added to `loss` here (its `compute_loss` did not run), and logged
        under its name (`critic_l2_penalty`); its input-gradient penalty
        is taken at `penalty_inputs`, the gradient of the network's output
        with respect to them (WGAN-GP's interpolated samples). A loss that
        came from this model's own `compute_loss` in the same step already
        holds them and is not penalized twice.

        Call it inside a training step (in the replica context under
        `tf.distribute`).

        Args:
            loss: A function of no arguments returning the scalar loss, or
                (TensorFlow) a scalar tensor recorded by `tape`. The loss is
                as Keras' losses compute it: a mean over this replica's
                batch which, under `tf.distribute`, Keras' loss objects and
                `compute_loss` divide by the replica count. Not loss-scaled:
                this method calls `optimizer.scale_loss` itself.
            tape: With a loss tensor, the `tf.GradientTape` that recorded it
                (it may still be recording, or have stopped). `None` with a
                loss function.
            variables: List of the variables to update. Defaults to
                `self.trainable_variables`.
            optimizer: The optimizer to update them with. Defaults to
                `self.optimizer`.
            penalty_inputs: Inputs of this network at which its
                `input_gradient_penalty` is taken (a tensor or the nested
                structure the network takes). Needed exactly when the
                network has that option.
            has_aux: Bool. If `True`, the loss function returns a pair
                `(loss, aux)` and `minimize` returns `(applied, aux)`.
                Defaults to `False` (the function returns the loss).

        Returns:
            `applied`: `None` when the update is applied unconditionally (a
            `LossScaleOptimizer` may still skip it, as in Keras); otherwise
            a boolean scalar tensor, true when this call changed the
            variables (false on a skipped non-finite step, or on a
            micro-batch of gradient accumulation). With `has_aux=True`,
            the pair `(applied, aux)`, `aux` as the loss function returned
            it, every tensor in it without gradient (whether or not the
            update is applied).

        Raises:
            ValueError: If `loss` is a tensor without its tape or a
                function with one, if there is no optimizer, the optimizer
                has its own `gradient_accumulation_steps`, `penalty_inputs` is
                missing or has no use, `transform_gradients` returns a
                list that does not match the variables, or the loss
                function's result does not match `has_aux` (found once
                the function ran: layer state its forward pass updated,
                such as batch statistics, stays updated).
        """
        if not isinstance(has_aux, bool):
            raise ValueError(
                "`has_aux` must be True or False. Received: "
                f"has_aux={has_aux!r}."
            )
        if callable(loss):
            if tape is not None:
                raise ValueError(
                    "`minimize` takes a loss function, or a loss tensor and "
                    "the tape that recorded it. Received: a function and "
                    f"tape={tape!r}. Leave `tape` out with a loss function."
                )
            function = loss
            update = _update.of_loss_function(
                self,
                lambda: _update.loss_and_aux(function(), has_aux),
                variables,
                optimizer,
                penalty_inputs,
            )
            if has_aux:
                return update.applied, _update.without_gradient(update.aux)
            return update.applied
        if has_aux:
            raise ValueError(
                "`has_aux=True` takes a loss function returning `(loss, "
                "aux)`. Received: a loss tensor and its tape (whatever else "
                "the tape recorded is in your hands already). Leave "
                "`has_aux` out, or pass a function."
            )
        if tape is None:
            raise ValueError(
                "A loss tensor needs the tape that recorded it. Received: "
                "tape=None. Pass the tape, or pass a function of no "
                "arguments that computes the loss."
            )
        return _update.of_recorded_loss(
            self, loss, tape, variables, optimizer, penalty_inputs
        ).applied

    def option_in_step(self, name: str) -> Any:
        """Returns option `name` as the running step uses it.

        Call it inside the step (a hook such as `transform_gradients`) to
        read an option declared with `schedulable=True`: a schedule is
        evaluated at the update count of the optimizer of the running update,
        before the update (0 at the first step), as Keras evaluates a
        learning-rate schedule, and the value in force is reported under the
        option's `logged_as` name (`"last"` reduction); any other value is
        returned as is.

        Args:
            name: String. The name of an option of the model.

        Returns:
            The option's value, or a float32 scalar tensor for a schedule.

        Example:

        ```python
        def transform_gradients(self, gradients, variables):
            stddev = self.option_in_step("gradient_noise_stddev")
            ...
        ```
        """
        options = _options.declared_options(type(self))
        if name not in options:
            raise ValueError(
                f"`option_in_step` reads a declared option of the model. "
                f"Received: name={name!r}. The options of "
                f"{type(self).__name__} are {list(options)}."
            )
        value = getattr(self, name)
        if not _validation.is_schedule(value):
            return value
        optimizer = getattr(
            _model_state.state_of(self).local, "optimizer", None
        )
        optimizer = optimizer or self.optimizer
        current = ops.cast(
            value(ops.convert_to_tensor(optimizer.iterations)), "float32"
        )
        self._report(options[name].logged_as, current, reduction="last")
        return current

    def _add_penalties(self, loss: Tensor, penalty_inputs: Any) -> Tensor:
        """Returns the loss `minimize` differentiates: here, `loss` itself.

        `RegularizationMixin` adds the network's penalties.
        """
        if penalty_inputs is not None:
            raise ValueError(
                "`penalty_inputs` is only used by an input-gradient penalty, "
                f"and the model {self.name!r} has none. Received: "
                "penalty_inputs=<given>. Build the network with "
                "custom_fit.RegularizationMixin and input_gradient_penalty=, "
                "or leave `penalty_inputs` out."
            )
        return loss

    # The step.

    def train_step(self, data: Any) -> Logs:
        """Runs one training step: forward pass, loss, `minimize`, metrics.

        Args:
            data: A batch, as produced by the data adapter of `fit`.

        Returns:
            A dict of metric results, as `keras.Model.train_step` returns.
        """
        # The step's reports reach their packs in one update each, when
        # its logs are taken (after the guard's verdict).
        with _model_state.state_of(self).metrics.batched():
            return self._train_step(data)

    def _train_step(self, data: Any) -> Logs:
        """`train_step`, its reports collected."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        before = _model_state.state_of(self).guard.keep(self._keras_metrics())

        def loss_function() -> tuple[Any, Any]:
            y_pred = self.forward_pass(x, training=True)
            loss = _keras_compat.compute_loss(
                self, x, y, y_pred, sample_weight, training=True
            )
            if self.per_loss_gradients:
                return (
                    _per_loss.loss_parts(self, y, y_pred, sample_weight, loss),
                    y_pred,
                )
            return loss, y_pred

        update = _update.of_loss_function(
            self, BatchLoss(loss_function, x, y, sample_weight), None, None
        )
        loss, y_pred, counted = update.loss, update.aux, update.counted
        return self._end_train_step(
            x, y, y_pred, sample_weight, loss, counted, before
        )

    def _end_train_step(
        self,
        x: Any,
        y: Any,
        y_pred: Any,
        sample_weight: Any,
        loss: Tensor,
        counted: Tensor | None,
        before: "_guard.StepStart | None" = None,
    ) -> Logs:
        """Tracks the loss, updates the compiled metrics, returns the logs.

        A batch that is not `counted` (a skipped step) changes no metric and
        no layer state: the guard writes back what it kept.
        """
        _keras_compat.track_loss(self, loss, x)
        self._note_loss_tracked()
        if before is None:
            logs = self.compute_metrics(
                x, y, y_pred, sample_weight=sample_weight
            )
            return backend.current().reducible_logs(self, logs)
        # The logs are those after the guard's verdict: the ones
        # `compute_metrics` would compute before it are not made.
        with self._logs_deferred():
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        _model_state.state_of(self).guard.undo_if_skipped(before, counted)
        return backend.current().reducible_logs(self, self.get_metrics_result())

    def test_step(self, data: Any) -> Logs:
        """Runs one evaluation step: forward pass, loss, metrics.

        Args:
            data: A batch, as produced by the data adapter of `evaluate`.

        Returns:
            A dict of metric results, without the metrics reported only in
            training (such as `skipped_steps`).
        """
        with _model_state.state_of(self).metrics.batched():
            return self._test_step(data)

    def _test_step(self, data: Any) -> Logs:
        """`test_step`, its reports collected."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self.forward_pass(x, training=False)
        loss = _keras_compat.compute_loss(
            self, x, y, y_pred, sample_weight, training=False
        )
        _keras_compat.track_loss(self, loss, x)
        self._note_loss_tracked()
        logs = self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return backend.current().reducible_logs(self, logs)

    def _note_loss_tracked(self) -> None:
        """Notes that the running kind of step logs Keras' `loss`."""
        metrics = _model_state.state_of(self).metrics
        metrics.kinds.setdefault("loss", set()).add(metrics.step())

    # Metrics reported from inside the step.

    def gradient_global_norm(self, gradients: Gradients) -> Tensor:
        """Returns the global norm of `gradients`, shared within the update.

        Call it from a hook (`transform_gradients`): within one update the
        squared norms of a list of gradients are computed once and shared
        by every reader (global clipping, the guard of `skip_nonfinite`,
        inspection's per-layer norms, and your transform), so asking for
        the norm of the gradients your hook received costs no second pass
        over them. Outside a step it computes the norm.

        Args:
            gradients: List of gradients (`None` entries ignored), as a hook
                receives them.

        Returns:
            A float32 scalar tensor: the square root of the sum of every
            entry's square.
        """
        return _figures.of(self, gradients).norm

    def scale_gradients(
        self, gradients: Gradients, factor: Scalar
    ) -> Gradients:
        """Returns `gradients` times one `factor`, with their figures known.

        For a transform that multiplies every gradient by the same scalar
        (a normalization, a clipping of your own): the hooks after it
        (the guard, inspection) read the result's norm from the input's
        and the factor, instead of a second pass over every gradient, as
        they would for gradients multiplied by `ops.multiply`. (Float32
        gradients; in another dtype, such as float16 under mixed
        precision, the product's rounding differs from the derived figures
        and the readers after it take their own pass.)

        Args:
            gradients: List of gradients (`None` kept; sparse ones keep
                their indices).
            factor: Python float or scalar tensor.

        Returns:
            The scaled list, aligned with `gradients`.

        Raises:
            ValueError: If `factor` is not a scalar.
        """
        if len(ops.shape(factor)) != 0:
            raise ValueError(
                "scale_gradients multiplies every gradient by one scalar. "
                f"Received: a factor of shape {tuple(ops.shape(factor))}. "
                "Pass a float or a scalar tensor."
            )
        present = [g for g in gradients if g is not None]
        if not present:
            return list(gradients)
        figures = _figures.of(self, gradients)
        factor = ops.cast(factor, "float32")
        scaled = iter(backend.current().scaled(present, factor))
        result = [None if g is None else next(scaled) for g in gradients]
        if all(
            keras.backend.standardize_dtype(g.dtype) in ("float32", "float64")
            for g in present
        ):
            # Float32 products match the derived figures; any factor.
            _figures.register(
                self, figures.scaled(result, factor, at_most_one=False)
            )
        return result

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
        in validation logs, and the other way round. With `skip_nonfinite`,
        a skipped step updates no metric: its reports are dropped.

        When this model is a network inside another custom_fit model whose
        `fit` runs (a GAN's discriminator, updated with `minimize`), the log
        key is prefixed with this model's name: `discriminator_grad_norm`.
        The outer model lists such metrics among its own, so Keras logs and
        resets them.

        The name may not be one that Keras already logs: `loss`, a compiled
        loss or metric (`accuracy`, `mae`, `<output>_loss`), or an output's
        name. To log your own loss under `loss`, override `compute_loss`:
        Keras tracks what it returns.

        A mixin owns the names it lists in its class attribute `reports`
        (each with its `<name>/...` keys): only the methods of a class that
        lists the name report it, and a report from anywhere else (another
        mixin, the model's class, code outside the model) is refused,
        naming the owner. A subclass that reports a name of its base lists
        it in its own `reports` too.

        Args:
            name: String. The log key.
            value: Scalar tensor. This step's value.
            sample_weight: Optional scalar weight of this step's value in the
                epoch mean (Keras weights the loss by the batch size).
            reduction: `"mean"` (weighted running mean over the epoch, each
                replica's value counted with its weight), `"sum"` (total
                over the epoch's steps; under `tf.distribute` the value must
                be the same on every replica, and is counted once),
                `"last"` (the last step's value: what a batch-level callback
                sees is each step's own value, and the epoch's log is its
                last step's; the value must be the same on every replica;
                for a value in force, such as a schedule's) or `"step"` (as
                `"last"`, in batch logs only: epoch logs and History leave
                it out, for a figure of one step that says nothing of the
                epoch).

        Raises:
            ValueError: If `reduction` is not one of `"mean"`, `"sum"`,
                `"last"` and `"step"`, if
                `name` is already the name of another metric or output of
                the model, or one another class of the model lists in its
                `reports` (`grad_norm`), or if `value` is not a scalar.

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
        outputs = getattr(self, "output_names", None) or ()
        if name in outputs:
            raise ValueError(
                f"The model already has an output named {name!r}, under "
                f"which Keras logs its losses and metrics. Received: "
                f"name={name!r}. Report it under another name."
            )
        declaring = _options.declaring_classes(type(self), name)
        if declaring:
            frame = inspect.currentframe()
            try:
                caller = _options.reporting_class(
                    self, frame.f_back if frame is not None else None
                )
            finally:
                del frame  # no cycle holding the callers' locals
            if caller not in declaring:
                raise ValueError(
                    f"{declaring[-1].__name__} logs {name!r} itself (it is "
                    f"in its `reports`); a report from elsewhere would be "
                    "averaged with its own. Received: name="
                    f"{name!r}, reported from "
                    f"{caller.__name__ if caller else 'outside the model'}. "
                    "Report it under another name, or list it in the "
                    "`reports` of the class whose method reports it."
                )
        self._report(name, value, sample_weight, reduction)

    def _report(
        self,
        name: str,
        value: Scalar,
        sample_weight: Scalar | None = None,
        reduction: str = "mean",
        held: bool = True,
    ) -> None:
        """`report_metric`; with `held=False` never held for the verdict."""
        _model_state.state_of(self).metrics.report(
            self, name, value, sample_weight, reduction, held
        )

    def _warn_once(self, key: str, message: str) -> None:
        """Emits `message` as a `UserWarning` once per model and `key`."""
        warned = _model_state.state_of(self).warned
        if key in warned:
            return
        warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)
