"""The update pipeline: from a loss to the optimizer's update.

`TrainStepMixin.minimize` (and so `train_step`) runs it once per network:
the loss function differentiated by the model's `compute_gradients` (true
gradients), then for the update's variables: accumulation (with
`gradient_accumulation_steps`), `finalize_gradients`,
`transform_gradients` (checked), the non-finite guard's verdict,
`inspect_gradients` and `apply_gradients` (on update steps only, with
accumulation), the guard's counts; variables Keras overwrites with their
"gradient" (float8 state) are written as they are. The gradient figures
(norms, finiteness) are computed once per update and shared
(`custom_fit._figures`). Each step of it is a hook of the model; this
module holds the order, and `docs/guides/the-step.md` tells it.
"""

import dataclasses
import warnings
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from custom_fit import _figures
from custom_fit import _guard
from custom_fit import _model_state
from custom_fit import _step_checks
from custom_fit import accumulation
from custom_fit import backend
from custom_fit import pipeline
from custom_fit._types import Gradients
from custom_fit._types import ModelBase
from custom_fit._types import Optimizer
from custom_fit._types import Tensor
from custom_fit._types import Variable


@dataclasses.dataclass(frozen=True, eq=False)  # identity, as a function's
class BatchLoss:
    """The loss function of a training step, with the batch it runs on.

    Called with no argument it returns `(loss, y_pred)`, as every loss
    function `compute_gradients` receives. `train_step` passes one, so
    that a mixin computing gradients from the examples themselves (the
    per-example gradients of `DifferentialPrivacyMixin`) finds them here; a
    plain function given to `minimize` has no batch.

    Attributes:
        function: Callable of no arguments returning `(loss, y_pred)`.
        x: The inputs of the batch.
        y: Its targets.
        sample_weight: Its sample weights, or `None`.
    """

    function: Callable[[], tuple[Any, Any]]
    x: Any
    y: Any
    sample_weight: Any

    def __call__(self) -> tuple[Any, Any]:
        """Returns `(loss, y_pred)` of the batch."""
        return self.function()

    def with_function(self, function: Callable[[], Any]) -> "BatchLoss":
        """Returns the same batch with another loss function."""
        return dataclasses.replace(self, function=function)


@dataclasses.dataclass(frozen=True)
class Update:
    """The outcome of one call of the gradient pipeline.

    Attributes:
        loss: The loss differentiated (penalties included).
        aux: The loss function's other output (`y_pred` in `train_step`).
        applied: `None` when the update is applied unconditionally, else a
            boolean scalar tensor: whether this call changed the variables.
        counted: `None`, or a boolean scalar tensor (with `skip_nonfinite`):
            whether this batch's own gradients were finite, so that its
            loss and metrics count in the epoch's figures.
    """

    loss: Tensor
    aux: Any
    applied: Tensor | None
    counted: Tensor | None


def loss_and_aux(result: Any, has_aux: bool) -> tuple[Any, Any]:
    """Returns `(loss, aux)` of a loss function's `result`, checked."""
    is_pair = isinstance(result, (tuple, list))
    if has_aux:
        if not is_pair or len(result) != 2:
            raise ValueError(
                "With `has_aux=True` the loss function returns a pair "
                "`(loss, aux)`. Received: a result of type "
                f"{type(result).__name__}"
                + (f" with {len(result)} items" if is_pair else "")
                + ". Return `loss, aux`, or leave `has_aux` out."
            )
        return result[0], result[1]
    if is_pair:
        raise ValueError(
            "The loss function returned a "
            f"{type(result).__name__} of {len(result)} items; `minimize` "
            "differentiates a scalar loss. To get other values back, return "
            "`(loss, aux)` and pass `has_aux=True`: "
            "`applied, aux = model.minimize(loss_function, has_aux=True)`."
        )
    return result, None


def without_gradient(aux: Any) -> Any:
    """Returns `aux` with every tensor in it cut from the gradient."""
    return keras.tree.map_structure(
        lambda value: (
            ops.stop_gradient(value) if ops.is_tensor(value) else value
        ),
        aux,
    )


def of_loss_function(
    model: Any,
    loss_function: Callable[[], tuple[Tensor, Any]],
    variables: Sequence[Variable] | None,
    optimizer: Optimizer | None,
    penalty_inputs: Any = None,
) -> Update:
    """`minimize` of a loss function returning `(loss, aux)`.

    With `variables=None`, the model's trainable variables are read
    after the loss function ran (it builds an unbuilt model); without
    any, Keras' warning is given and nothing is updated.
    """
    optimizer = prepared(model, optimizer)

    def penalized() -> tuple[Tensor, Any]:
        loss, aux = loss_function()
        return model._add_penalties(loss, penalty_inputs), aux

    function: Callable[[], tuple[Tensor, Any]] = penalized
    if isinstance(loss_function, BatchLoss):
        function = loss_function.with_function(penalized)
    loss, aux, gradients = model.compute_gradients(
        function, variables, optimizer=optimizer
    )
    if variables is None:
        variables = model.trainable_variables
    if not variables:
        warnings.warn(
            "The model does not have any trainable weights.", stacklevel=3
        )
        return Update(loss=loss, aux=aux, applied=None, counted=None)
    return run(model, loss, aux, gradients, list(variables), optimizer)


def of_recorded_loss(
    model: Any,
    loss: Tensor,
    tape: Any,
    variables: Sequence[Variable] | None,
    optimizer: Optimizer | None,
    penalty_inputs: Any = None,
) -> Update:
    """`minimize` of a loss recorded on a TensorFlow tape.

    The gradients come from the tape, so `compute_gradients` is not
    called; the rest of the pipeline is the same.
    """
    # Refused where no tape records (with the neutral form as the fix).
    backend.current().check_recorded_loss(tape)
    optimizer = prepared(model, optimizer)
    variables = list(
        model.trainable_variables if variables is None else variables
    )
    with tape:
        loss = model._add_penalties(loss, penalty_inputs)
        scaled_loss = optimizer.scale_loss(loss)
    gradients = backend.current().recorded_gradients(
        tape, scaled_loss, variables
    )
    gradients = pipeline.true_gradients(gradients, variables, optimizer)
    return run(model, loss, None, gradients, variables, optimizer)


def prepared(model: Any, optimizer: Optimizer | None) -> Optimizer:
    """Returns the optimizer of an update, checked and tracked."""
    optimizer = _step_checks.checked_optimizer(model, optimizer)
    _step_checks.warn_about_optimizer_clipping(model, optimizer)
    # Schedules of this update's options follow this optimizer's count.
    _model_state.state_of(model).local.optimizer = optimizer
    driver = _model_state.state_of(model).metrics.driver
    if driver is not None:
        owner = driver[0]
        if optimizer is not getattr(owner, "optimizer", None):
            # Its variables must travel with the driver's step (JAX).
            _model_state.state_of(owner).holder.track_optimizer(optimizer)
    return optimizer


def run(
    model: Any,
    loss: Tensor,
    aux: Any,
    gradients: Gradients,
    variables: list[Variable],
    optimizer: Optimizer,
) -> Update:
    """Runs the pipeline after `compute_gradients`.

    From true gradients to the update, through accumulation,
    transforms, inspection and the guard. Variables that Keras
    overwrites with their "gradient" (`overwrite_with_gradient`: the
    scales and amax history of float8 layers) pass through none of it:
    their values are written as they are, as Keras' optimizer does,
    when the batch counts. The gradient figures (norms, finiteness)
    are computed once for the update and shared (`custom_fit._figures`).
    """
    with _figures.open_book(model):
        guard = _model_state.state_of(model).guard
        gradients, variables, overwritten = pipeline.split_overwritten(
            gradients, variables
        )
        # Whether the batch counts in the epoch's figures: its own
        # gradients are finite (with accumulation), or the update is applied.
        accumulating = model.gradient_accumulation_steps not in (None, 1)
        counted = guard.batch_is_finite(gradients) if accumulating else None
        # Past the consecutive-skip limit (read by the host one call late)
        # a step changes nothing at all, accumulation included.
        frozen = guard.past_limit()
        if frozen is not None and counted is not None:
            counted = ops.logical_and(counted, ops.logical_not(frozen))
        is_update = None
        if accumulating:
            accumulator = _accumulator(model, variables)
            gradients, is_update = accumulator.accumulate(
                gradients, frozen=frozen
            )
        gradients = model.finalize_gradients(gradients, variables, is_update)
        transformed = _transformed(model, gradients, variables)
        verdict = guard.decide(gradients, transformed, optimizer)
        applied = verdict.apply if guard.active else None
        if is_update is None:
            counted = applied
        # Reports from here on (inspection) are about the update.
        _model_state.state_of(model).metrics.settle(applied)
        _inspect_and_apply(
            model,
            gradients,
            transformed,
            variables,
            optimizer,
            verdict,
            is_update,
        )
        for name, count in guard.record(verdict, is_update).items():
            # Never held: a skipped step is counted.
            model._report(name, count, reduction="sum", held=False)
        if overwritten:
            pipeline.write_overwritten(overwritten, counted)
        if is_update is not None:
            applied = (
                is_update
                if applied is None
                else ops.logical_and(is_update, applied)
            )
        return Update(loss=loss, aux=aux, applied=applied, counted=counted)


def _transformed(
    model: Any, gradients: Gradients, variables: Sequence[Variable]
) -> Gradients:
    """Runs `transform_gradients` and checks what it returns."""
    transformed = model.transform_gradients(gradients, variables)
    _step_checks.check_transformed(gradients, transformed, variables)
    return list(transformed)


def _inspect_and_apply(
    model: Any,
    gradients: Gradients,
    transformed: Gradients,
    variables: Sequence[Variable],
    optimizer: Optimizer,
    verdict: _guard.Verdict,
    is_update: Tensor | None,
) -> None:
    """Inspects and applies, on update steps only with accumulation."""

    def inspect() -> None:
        model.inspect_gradients(
            gradients, transformed, variables, optimizer=optimizer
        )

    def apply(transformed: Gradients, finite: Tensor | None) -> None:
        model.apply_gradients(
            transformed, variables, finite=finite, optimizer=optimizer
        )

    if is_update is None:
        inspect()
        apply(transformed, verdict.apply)
        return
    # Reports in a conditional branch are made in the branch.
    in_branch = _model_state.state_of(model).metrics.in_branch
    backend.current().run_if(is_update, in_branch(inspect))
    backend.current().run_if(
        is_update,
        in_branch(apply),
        args=(transformed, verdict.apply),
        synchronized=True,
    )


def _accumulator(
    model: Any, variables: Sequence[Variable]
) -> accumulation.GradientAccumulator:
    """Returns the gradient accumulator of `variables`, made once."""
    accumulators = _model_state.state_of(model).accumulators
    key = tuple(id(variable) for variable in variables)
    if key not in accumulators:
        # Its state is the model's declared state, per set of variables.
        accumulators[key] = accumulation.GradientAccumulator(
            variables,
            model.gradient_accumulation_steps,
            sums=model._gradient_sums.of(variables, key=key),
            count=model._accumulation_counts.variable((), key=key),
        )
    return accumulators[key]


class Minimizing(ModelBase):
    """`minimize`: the public entry of the update pipeline.

    A base of `TrainStepMixin` (not for direct use): its methods are the
    model's.
    """

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
            update = of_loss_function(
                self,
                lambda: loss_and_aux(function(), has_aux),
                variables,
                optimizer,
                penalty_inputs,
            )
            if has_aux:
                return update.applied, without_gradient(update.aux)
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
        return of_recorded_loss(
            self, loss, tape, variables, optimizer, penalty_inputs
        ).applied

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
