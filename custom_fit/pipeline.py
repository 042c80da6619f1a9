"""True gradients in, optimizer update out: the two ends of the pipeline.

Between differentiation and `optimizer.apply`, Keras leaves gradients in a
state that is wrong for anything that inspects or modifies them:

- **Loss-scaled.** Under mixed precision (`LossScaleOptimizer`, which
  `compile` adds for the `"mixed_float16"` policy) or with an optimizer's
  `loss_scale_factor`, they are multiplied by the loss scale, and the
  optimizer divides it out only inside `apply`.
- **Per replica** (TensorFlow). Under `tf.distribute`, each replica holds
  the gradient of its share of the global batch (scaled by
  `1 / num_replicas`); the optimizer sums them across replicas only inside
  `apply`, after its own clipping. (On JAX, a step under
  `keras.distribution` is traced over the global batch: its gradients are
  already the global ones.)

`true_gradients` undoes both at once, so its result equals the
single-device gradient of the global batch. `apply_true_gradients` hands
such gradients to the optimizer without the optimizer unscaling or summing
them a second time. A custom_fit model's `compute_gradients` hook returns
true gradients already; these functions serve hand-written steps:

```python
loss, _, grads = model.compute_gradients(loss_function, variables)
grads = custom_fit.clipping.clip_by_global_norm(grads, 1.0)
apply_true_gradients(optimizer, grads, variables)
```

`replica_count`, `all_reduce_sum`, `run_if` and `assign_variables` are the
backend adapter's own functions, public here for such steps; custom_fit's
core calls the adapter (`custom_fit.backend.current()`) directly: one
route from the core to a backend.
"""

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from custom_fit import _gradient_ops
from custom_fit import _keras_compat
from custom_fit import backend
from custom_fit._types import Gradient
from custom_fit._types import Gradients
from custom_fit._types import Tensor
from custom_fit._types import Variable

__all__ = [
    "all_reduce_sum",
    "apply_true_gradients",
    "compute_true_gradients",
    "loss_scale",
    "optimizer_clipping",
    "replica_count",
    "true_gradients",
]


_OPTIMIZER_CLIPPING_ARGUMENTS = ("clipnorm", "clipvalue", "global_clipnorm")


def loss_scale(
    optimizer: keras.optimizers.Optimizer | None,
) -> float | Tensor | None:
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
            return ops.convert_to_tensor(optimizer.dynamic_scale)
        return optimizer.initial_scale
    return getattr(optimizer, "loss_scale_factor", None)


def replica_count() -> int:
    """Returns the number of replicas whose gradients are summed per step.

    Returns:
        On TensorFlow, `num_replicas_in_sync` of the current replica
        context, or 1 outside any (cross-replica context). On JAX, 1: a
        step is traced over the global batch.
    """
    return backend.current().replica_count()


def _multiply(
    gradients: Sequence[Gradient],
    variables: Sequence[Variable],
    factor: float | Tensor,
) -> Gradients:
    """Multiplies each gradient by `factor`.

    Variables that Keras overwrites with their gradient (float8 scales) are
    left alone, as Keras never scales them.
    """
    kept = [
        g is not None and not is_overwritten(v)
        for g, v in zip(gradients, variables)
    ]
    scaled = _gradient_ops.scale_all(
        [g if keep else None for g, keep in zip(gradients, kept)], factor
    )
    return [new if keep else g for g, new, keep in zip(gradients, scaled, kept)]


def is_overwritten(variable: Variable) -> bool:
    """Whether Keras overwrites `variable` with its gradient (float8 state).

    Keras' optimizer writes such a variable's "gradient" (a new value the
    layer computed, not a derivative) into it directly, without unscaling,
    clipping or any update rule.
    """
    return bool(getattr(variable, "overwrite_with_gradient", False))


def split_overwritten(
    gradients: Sequence[Gradient], variables: Sequence[Variable]
) -> tuple[Gradients, list[Variable], list[tuple[Any, Variable]]]:
    """Separates the variables Keras overwrites with their gradient.

    Args:
        gradients: List aligned with `variables`.
        variables: The variables of an update.

    Returns:
        `(gradients, variables, overwritten)`: the gradients and variables
        of the update proper, and the `(new value, variable)` pairs of the
        overwritten ones (those with a value).
    """
    kept_gradients: Gradients = []
    kept_variables: list[Variable] = []
    overwritten: list[tuple[Any, Variable]] = []
    for gradient, variable in zip(gradients, variables):
        if not is_overwritten(variable):
            kept_gradients.append(gradient)
            kept_variables.append(variable)
        elif gradient is not None:
            overwritten.append((gradient, variable))
    return kept_gradients, kept_variables, overwritten


def true_gradients(
    gradients: Sequence[Gradient],
    variables: Sequence[Variable],
    optimizer: keras.optimizers.Optimizer | None,
) -> Gradients:
    """Returns the gradients of the unscaled loss on the global batch.

    Call it in the step (in the replica context under `tf.distribute`),
    on the gradients of the loss that `optimizer.scale_loss` returned.

    Args:
        gradients: List aligned with `variables`: the gradients of the
            scaled loss of this replica (tensors, `tf.IndexedSlices` on
            TensorFlow, or `None`).
        variables: The variables they belong to.
        optimizer: The optimizer that scaled the loss, or `None`.

    Returns:
        A list aligned with `variables`, equal to the gradient of the
        unscaled loss on one device with the global batch: loss scale
        divided out and, under `tf.distribute`, summed across replicas
        (over `torch.distributed` processes, their mean weighted by each
        process' batch size), so every replica holds the same values.
    """
    scale = loss_scale(optimizer)
    if scale is not None:
        gradients = _multiply(gradients, variables, 1.0 / scale)
    summed = backend.current().batch_gradients(gradients)
    replicas = replica_count()
    if replicas == 1:
        return summed
    # An overwritten variable's new value: the replicas' mean, not a sum.
    return [
        g / replicas if g is not None and is_overwritten(v) else g
        for g, v in zip(summed, variables)
    ]


def compute_true_gradients(
    tape: Any,
    scaled_loss: Tensor,
    variables: Sequence[Variable],
    optimizer: keras.optimizers.Optimizer | None,
) -> Gradients:
    """Returns the true gradients of a loss recorded on a TensorFlow tape.

    `true_gradients` of `tape.gradient(scaled_loss, variables)`.

    Args:
        tape: The `tf.GradientTape` that recorded `scaled_loss`.
        scaled_loss: Scalar tensor: the loss after `optimizer.scale_loss`.
        variables: List of the variables to differentiate.
        optimizer: The optimizer that scaled the loss, or `None`.

    Returns:
        A list aligned with `variables`; see `true_gradients`.
    """
    return true_gradients(
        tape.gradient(scaled_loss, list(variables)), variables, optimizer
    )


def all_reduce_sum(gradients: Sequence[Gradient]) -> Gradients:
    """Sums gradients across the replicas of the current replica context.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.

    Returns:
        The list of summed gradients, identical on every replica (`None`
        stays `None`); the input unchanged with a single replica or on
        JAX.
    """
    return backend.current().all_reduce_sum(gradients)


def apply_true_gradients(
    optimizer: keras.optimizers.Optimizer,
    gradients: Sequence[Gradient],
    variables: Sequence[Variable],
    finite: Tensor | None = None,
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
        factor = ops.where(finite, ops.cast(factor, "float32"), float("nan"))
    if not isinstance(factor, float) or factor != 1.0:
        gradients = _multiply(gradients, variables, factor)

    if not optimizer.built:
        optimizer.build(variables)
    tracked = _keras_compat.optimizer_trainable_variables(optimizer)

    def apply(gradients: Sequence[Any]) -> None:
        backend.current().apply_gradients(
            optimizer, gradients, variables, tracked
        )

    if finite is None or is_loss_scale_optimizer:
        apply(gradients)
    else:
        run_if(finite, apply, args=(gradients,), synchronized=True)


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
    # A MultiOptimizer's groups clip with their own optimizers.
    for member in [optimizer, *getattr(optimizer, "optimizers", [])]:
        for name in _OPTIMIZER_CLIPPING_ARGUMENTS:
            value = getattr(member, name, None)
            if value:
                found[name] = value
    return found


def run_if(
    condition: Tensor,
    function: Callable[..., object],
    args: tuple[Any, ...] = (),
    synchronized: bool = False,
) -> None:
    """Runs `function(*args)` only when `condition` is true.

    On TensorFlow a `tf.cond`; for functions that synchronise replicas
    under `tf.distribute` (the optimizer's `apply`), pass
    `synchronized=True`: the condition is then evaluated in cross-replica
    context, and `function` runs on each replica with that replica's
    `args` (pass every per-replica tensor through `args`, not a closure).
    On JAX, `function` runs and every state it changed is selected
    between the new and the old value by `condition`.

    Args:
        condition: Boolean scalar tensor, the same on every replica.
        function: Callable; its return value is dropped.
        args: Tuple of (nested) tensors passed to `function`.
        synchronized: Bool. Whether `function` synchronises replicas.
    """
    backend.current().run_if(condition, function, args, synchronized)


def assign_variables(
    variables: Sequence[Variable], values: Sequence[Any]
) -> None:
    """Assigns `values` to model variables, in a replica context too.

    Under `tf.distribute`, Keras model variables are mirrored and refuse a
    plain `assign` in replica context; the values (the same on every
    replica) are then written through the strategy, as the optimizer does.

    Args:
        variables: List of variables.
        values: List of tensors aligned with `variables`.
    """
    backend.current().assign_variables(variables, values)


def write_overwritten(
    overwritten: list[tuple[Any, Variable]], counted: Tensor | None
) -> None:
    """Writes new values into variables Keras overwrites (float8 state).

    Written at every batch that counts (skipped batches change nothing),
    also on the micro-batches of gradient accumulation: they are the
    layers' statistics of each batch, not gradients to average.
    """
    variables = [variable for _, variable in overwritten]
    values = [value for value, _ in overwritten]
    if counted is None:
        assign_variables(variables, values)
        return
    run_if(
        counted,
        lambda values: assign_variables(variables, values),
        args=(values,),
        synchronized=True,
    )
