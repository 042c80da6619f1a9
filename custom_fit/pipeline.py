"""True gradients in, optimizer update out: the two ends of the pipeline.

Between `tape.gradient` and `optimizer.apply`, Keras leaves gradients in a
state that is wrong for anything that inspects or modifies them:

- **Loss-scaled.** Under mixed precision (`LossScaleOptimizer`, which
  `compile` adds for the `"mixed_float16"` policy) or with an optimizer's
  `loss_scale_factor`, they are multiplied by the loss scale, and the
  optimizer divides it out only inside `apply`.
- **Per replica.** Under `tf.distribute`, each replica holds the gradient of
  its share of the global batch (scaled by `1 / num_replicas`); the
  optimizer sums them across replicas only inside `apply`, after its own
  clipping.

`compute_true_gradients` undoes both at once, so its result equals the
single-device gradient of the global batch. `apply_true_gradients` hands
such gradients to the optimizer without the optimizer unscaling or summing
them a second time.

```python
with tf.GradientTape() as tape:
    loss = ...
    scaled_loss = optimizer.scale_loss(loss)
grads = compute_true_gradients(tape, scaled_loss, variables, optimizer)
grads = custom_fit.clipping.clip_by_global_norm(grads, 1.0)
apply_true_gradients(optimizer, grads, variables)
```
"""

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import keras
import tensorflow as tf

from custom_fit import _gradient_ops
from custom_fit._types import Gradient
from custom_fit._types import Gradients
from custom_fit._types import Variable

_OPTIMIZER_CLIPPING_ARGUMENTS = ("clipnorm", "clipvalue", "global_clipnorm")


def loss_scale(
    optimizer: keras.optimizers.Optimizer | None,
) -> float | tf.Tensor | None:
    """Returns the factor by which `optimizer.scale_loss` multiplies a loss.

    Args:
        optimizer: A `keras.optimizers.Optimizer`, or `None`.

    Returns:
        `None` when the optimizer does not scale the loss; else a float or
        a scalar tensor (the current dynamic scale of a
        `LossScaleOptimizer`).
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if optimizer.built:
            return tf.convert_to_tensor(optimizer.dynamic_scale)
        return optimizer.initial_scale
    return getattr(optimizer, "loss_scale_factor", None)


def replica_count() -> int:
    """Returns the number of replicas whose gradients are summed per step.

    Returns:
        `num_replicas_in_sync` of the current replica context, or 1 outside
        any (cross-replica context).
    """
    context = tf.distribute.get_replica_context()
    if context is None:
        return 1
    return context.num_replicas_in_sync


def _multiply(
    gradients: Sequence[Gradient],
    variables: Sequence[Variable],
    factor: float | tf.Tensor,
) -> Gradients:
    """Multiplies each gradient by `factor`.

    Variables that Keras overwrites with their gradient (float8 scales) are
    left alone, as Keras never scales them.
    """
    return [
        g
        if g is None or getattr(v, "overwrite_with_gradient", False)
        else _gradient_ops.map_values(
            lambda values: values * tf.cast(factor, values.dtype), g
        )
        for g, v in zip(gradients, variables)
    ]


def compute_true_gradients(
    tape: tf.GradientTape,
    scaled_loss: tf.Tensor,
    variables: Sequence[Variable],
    optimizer: keras.optimizers.Optimizer | None,
) -> Gradients:
    """Returns the unscaled gradients of the global batch.

    Call it in the replica context of a training step (inside `train_step`,
    or a function run by `strategy.run`), with the loss returned by
    `optimizer.scale_loss`.

    Args:
        tape: The `tf.GradientTape` that recorded `scaled_loss`.
        scaled_loss: Scalar tensor: the loss after `optimizer.scale_loss`
            (under `tf.distribute`, the per-replica loss that Keras scales
            by `1 / num_replicas`).
        variables: List of the variables to differentiate.
        optimizer: The optimizer that scaled the loss, or `None`.

    Returns:
        A list aligned with `variables`: tensors, `tf.IndexedSlices` or
        `None`. They equal the gradient of the unscaled loss on one device
        with the global batch: loss scale divided out, and summed across
        replicas, so every replica holds the same values.
    """
    gradients = tape.gradient(scaled_loss, variables)
    scale = loss_scale(optimizer)
    if scale is not None:
        gradients = _multiply(gradients, variables, 1.0 / scale)
    return all_reduce_sum(gradients)


def all_reduce_sum(gradients: Sequence[Gradient]) -> Gradients:
    """Sums gradients across the replicas of the current replica context.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.

    Returns:
        The list of summed gradients, identical on every replica (`None`
        stays `None`); the input unchanged with a single replica.
    """
    if replica_count() == 1:
        return list(gradients)
    present = [g for g in gradients if g is not None]
    if not present:
        return list(gradients)
    summed = iter(
        tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, present
        )
    )
    return [None if g is None else next(summed) for g in gradients]


def apply_true_gradients(
    optimizer: keras.optimizers.Optimizer,
    gradients: Sequence[Gradient],
    variables: Sequence[Variable],
    finite: tf.Tensor | None = None,
) -> None:
    """Applies true gradients with `optimizer`, scaled so it sees them once.

    `optimizer.apply` divides by the loss scale and sums across replicas.
    For gradients that are already true, this function first multiplies by
    the loss scale and divides by the replica count, so the optimizer's own
    unscaling and summing give back exactly the gradients passed here (the
    loss scale of a `LossScaleOptimizer` and the replica counts in use are
    powers of two, so both steps are exact in floating point).

    Args:
        optimizer: A `keras.optimizers.Optimizer`.
        gradients: List aligned with `variables`, as returned by
            `compute_true_gradients` (optionally transformed); the same on
            every replica.
        variables: List of the variables to update.
        finite: Optional boolean scalar tensor, the same on every replica.
            When given and `False`, no model or optimizer variable changes,
            except that a `LossScaleOptimizer` halves its dynamic scale, as it
            does on any non-finite step. When `None`, the update is applied
            unconditionally.
    """
    factor = 1.0
    scale = loss_scale(optimizer)
    if scale is not None:
        factor = scale
    replicas = replica_count()
    if replicas > 1:
        factor = factor / replicas
    is_loss_scale_optimizer = isinstance(
        optimizer, keras.optimizers.LossScaleOptimizer
    )
    if is_loss_scale_optimizer and finite is not None:
        # A NaN factor makes the LossScaleOptimizer see a non-finite step
        # even when clipping turned infinities into finite numbers.
        factor = tf.where(finite, tf.cast(factor, tf.float32), float("nan"))
    if not isinstance(factor, float) or factor != 1.0:
        gradients = _multiply(gradients, variables, factor)

    if finite is None or is_loss_scale_optimizer:
        optimizer.apply(gradients, variables)
    else:
        run_if(
            finite,
            lambda gradients: optimizer.apply(gradients, variables),
            args=(gradients,),
        )


def optimizer_clipping(
    optimizer: keras.optimizers.Optimizer | None,
) -> dict[str, float]:
    """Returns the clipping arguments that `optimizer` itself applies.

    Args:
        optimizer: A `keras.optimizers.Optimizer` (a `LossScaleOptimizer`
            is looked through), or `None`.

    Returns:
        A dict of the set `clipnorm`, `clipvalue` and `global_clipnorm`
        arguments (empty when the optimizer does not clip).
    """
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    found: dict[str, float] = {}
    for name in _OPTIMIZER_CLIPPING_ARGUMENTS:
        value = getattr(optimizer, name, None)
        if value:
            found[name] = value
    return found


def run_if(
    condition: tf.Tensor,
    function: Callable[..., object],
    args: tuple[Any, ...] = (),
) -> None:
    """Runs `function(*args)` only when `condition` is true, on every replica.

    Outside `tf.distribute` this is a `tf.cond`. Under a strategy, the
    optimizer's `apply` synchronises replicas with a `merge_call`, which may
    not sit in a `tf.cond` branch in replica context; the condition (the
    same on every replica) is then evaluated in cross-replica context, as
    `LossScaleOptimizer` does, and `function` runs on each replica with
    that replica's `args`.

    Pass every per-replica tensor `function` uses through `args`, not a
    closure: inside the cross-replica branch a closure would hand every
    replica the tensors of the replica that traced it, and Keras'
    all-reduce then sees one value where it expects one per replica (a
    wrong update). Variables may be captured.

    Args:
        condition: Boolean scalar tensor, the same on every replica.
        function: Callable; its return value is dropped.
        args: Tuple of (nested) per-replica tensors passed to `function`.
    """

    def run() -> tf.Tensor:
        function(*args)
        return tf.constant(True)

    def skip() -> tf.Tensor:
        return tf.constant(False)

    if _outside_replica_context():
        tf.cond(condition, run, skip)
        return

    def cross_replica(
        strategy: tf.distribute.Strategy,
        condition: tf.Tensor,
        args: tuple[Any, ...],
    ) -> None:
        first = strategy.experimental_local_results(condition)[0]

        def run_on_each_replica() -> tf.Tensor:
            strategy.extended.call_for_each_replica(function, args=args)
            return tf.constant(True)

        tf.cond(first, run_on_each_replica, skip)

    tf.distribute.get_replica_context().merge_call(
        cross_replica, args=(condition, tuple(args))
    )


def assign_variables(
    variables: Sequence[Variable], values: Sequence[tf.Tensor]
) -> None:
    """Assigns `values` to model variables, in replica context too.

    Keras model variables are mirrored under `tf.distribute` and refuse a
    plain `assign` in replica context; the values (the same on every
    replica) are then written through the strategy, as the optimizer does.

    Args:
        variables: List of variables.
        values: List of tensors aligned with `variables`.
    """
    if _outside_replica_context():
        for variable, value in zip(variables, values):
            variable.assign(value)
        return

    def cross_replica(
        strategy: tf.distribute.Strategy, values: list[tf.Tensor]
    ) -> None:
        for variable, value in zip(variables, values):
            strategy.extended.update(
                getattr(variable, "value", variable),
                lambda target, new: target.assign(new),
                args=(value,),
                group=False,
            )

    tf.distribute.get_replica_context().merge_call(
        cross_replica, args=(list(values),)
    )


def _outside_replica_context() -> bool:
    """Returns whether no strategy's replica context is current."""
    return (
        not tf.distribute.has_strategy()
        or tf.distribute.in_cross_replica_context()
    )
