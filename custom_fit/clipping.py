"""Gradient clipping as pure functions on lists of gradients.

Each function takes a list of gradients (dense tensors of the Keras backend,
`tf.IndexedSlices` on TensorFlow, or `None`) and returns a new list of the
same length, with `None` passed through untouched. They are written with
`keras.ops`, hold no state, and work eagerly, inside `tf.function`, under
XLA and `jax.jit`, so they can be used on their own in a hand-written loop:

```python
grads = tape.gradient(loss, model.trainable_variables)
grads = custom_fit.clipping.clip_by_global_norm(grads, 1.0)
optimizer.apply(grads, model.trainable_variables)
```

`tf.IndexedSlices` are first deduplicated (rows of a repeated index are
summed), so every norm and every element-wise clip acts on the true dense
gradient. Norms are accumulated in float32.
"""

from collections.abc import Hashable
from collections.abc import Sequence

import numpy as np
from keras import ops

from custom_fit import _gradient_ops
from custom_fit._types import Gradient
from custom_fit._types import Gradients
from custom_fit._types import Tensor
from custom_fit._types import Weight

__all__ = [
    "adaptive_clip",
    "all_finite",
    "clip_by_global_norm",
    "clip_by_group_norm",
    "clip_by_norm",
    "clip_by_value",
    "global_norm",
]


# Smallest gradient norm divided by in adaptive clipping, as in the NFNet
# reference implementation (Brock et al., 2021).
_ADAPTIVE_GRADIENT_NORM_FLOOR = 1e-6


def global_norm(gradients: Sequence[Gradient]) -> Tensor:
    """Returns the L2 norm of all gradients taken together.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.

    Returns:
        A float32 scalar tensor: `sqrt(sum of squares)` over every entry of
        every non-`None` gradient (0.0 when there are none).

    Example:
    ```python
    >>> float(global_norm([tf.constant([3.0]), None, tf.constant([4.0])]))
    5.0
    ```
    """
    squares = [_gradient_ops.squared_sum(g) for g in gradients if g is not None]
    if not squares:
        return ops.convert_to_tensor(0.0, "float32")
    return ops.sqrt(_gradient_ops.add_all(squares))


def all_finite(gradients: Sequence[Gradient]) -> Tensor:
    """Returns whether every entry of every gradient is finite.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.

    Returns:
        A boolean scalar tensor, `True` when no entry is NaN or infinite.

    Example:
    ```python
    >>> bool(all_finite([tf.constant([1.0, float("nan")])]))
    False
    ```
    """
    flags = [_gradient_ops.is_finite(g) for g in gradients if g is not None]
    if not flags:
        return ops.convert_to_tensor(True)
    if len(flags) == 1:
        return flags[0]
    return ops.all(ops.stack(flags))


def clip_by_value(gradients: Sequence[Gradient], clipvalue: float) -> Gradients:
    """Clips every entry of every gradient to `[-clipvalue, clipvalue]`.

    Same semantics as the `clipvalue` argument of `keras.optimizers`.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.
        clipvalue: Positive float. The largest absolute value kept.

    Returns:
        The list of clipped gradients.

    Example:
    ```python
    >>> clip_by_value([tf.constant([-3.0, 0.5])], 1.0)[0].numpy()
    array([-1. ,  0.5], dtype=float32)
    ```
    """
    return [
        _gradient_ops.map_values(
            lambda v: ops.clip(v, -clipvalue, clipvalue),
            _gradient_ops.deduplicate(g),
        )
        for g in gradients
    ]


def _scale(gradient: Gradient, factor: Tensor) -> Gradient:
    """Multiplies `gradient` by a float32 scalar `factor`."""
    return _gradient_ops.map_values(
        lambda v: v * ops.cast(factor, v.dtype), gradient
    )


# The smallest normal float32: a floor of the divisor of `_clip_factor`.
_TINY = float(np.finfo(np.float32).tiny)


def _clip_factor(norm: Tensor, max_norm: float) -> Tensor:
    """Returns `max_norm / norm` above the bound, else 1 (also at norm 0).

    `max_norm / max(norm, max_norm, tiny)`: the divisor is never zero, so a
    zero norm (all-zero sample weights) or a bound that is 0 in float32
    never gives 0/0. Two ops for a float bound: on an eager backend each op
    is a dispatch.
    """
    if isinstance(max_norm, (int, float)):
        return max_norm / ops.maximum(norm, max(float(max_norm), _TINY))
    return max_norm / ops.maximum(ops.maximum(norm, max_norm), _TINY)


def global_clip_factor(norm: Tensor, global_clipnorm: float) -> Tensor:
    """Returns the factor `clip_by_global_norm` multiplies every gradient by.

    `global_clipnorm / norm` above the bound, else 1; NaN when `norm` is
    not finite, so that the clipped step is recognised as non-finite.

    Args:
        norm: Float32 scalar tensor, the global norm of the gradients.
        global_clipnorm: Positive float. The largest global L2 norm.

    Returns:
        A float32 scalar tensor.
    """
    # `norm - norm` is 0 for a finite norm and NaN otherwise.
    return _clip_factor(norm, global_clipnorm) + (norm - norm)


def clip_by_norm(gradients: Sequence[Gradient], clipnorm: float) -> Gradients:
    """Rescales each gradient separately so its L2 norm is at most `clipnorm`.

    Same semantics as the `clipnorm` argument of `keras.optimizers`.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.
        clipnorm: Positive float. The largest L2 norm of each gradient.

    Returns:
        The list of clipped gradients.

    Example:
    ```python
    >>> clip_by_norm([tf.constant([3.0, 4.0])], 1.0)[0].numpy()
    array([0.6, 0.8], dtype=float32)
    ```
    """
    clipped: Gradients = []
    for g in gradients:
        if g is None:
            clipped.append(None)
            continue
        g = _gradient_ops.deduplicate(g)
        norm = ops.sqrt(_gradient_ops.squared_sum(g))
        clipped.append(_scale(g, _clip_factor(norm, clipnorm)))
    return clipped


def globally_clipped(
    gradients: Sequence[Gradient], global_clipnorm: float, norm: Tensor
) -> tuple[Gradients, Tensor]:
    """`clip_by_global_norm` with the norm given; also returns the factor.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.
        global_clipnorm: Positive float. The largest global L2 norm.
        norm: Float32 scalar tensor: the gradients' global norm.

    Returns:
        A pair: the clipped gradients, and the factor every gradient was
        multiplied by (`global_clip_factor`).
    """
    factor = global_clip_factor(norm, global_clipnorm)
    gradients = [_gradient_ops.deduplicate(g) for g in gradients]
    return _gradient_ops.scale_all(gradients, factor), factor


def clip_by_global_norm(
    gradients: Sequence[Gradient],
    global_clipnorm: float,
    norm: Tensor | None = None,
) -> Gradients:
    """Rescales all gradients together so their global norm is at most a bound.

    Same semantics as the `global_clipnorm` argument of `keras.optimizers`
    (Pascanu et al., 2013): when the global norm exceeds the bound, every
    gradient is multiplied by `global_clipnorm / global_norm`, which keeps
    the direction of the whole update. A non-finite global norm makes every
    entry NaN, so the step is recognised as non-finite downstream.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.
        global_clipnorm: Positive float. The largest global L2 norm.
        norm: Optional float32 scalar tensor: the gradients' global norm,
            when the caller has it already (it is not computed again).

    Returns:
        The list of clipped gradients.

    Example:
    ```python
    >>> grads = clip_by_global_norm([tf.constant([3.0]), tf.constant([4.0])],
    ...                             1.0)
    >>> [float(g[0]) for g in grads]
    [0.6, 0.8]
    ```
    """
    if norm is None:
        norm = global_norm([_gradient_ops.deduplicate(g) for g in gradients])
    return globally_clipped(gradients, global_clipnorm, norm)[0]


def clip_by_group_norm(
    gradients: Sequence[Gradient],
    groups: Sequence[Hashable | None],
    clipnorm: float,
) -> Gradients:
    """Rescales each group of gradients jointly to a bounded L2 norm.

    `GradientClippingMixin(layer_clipnorm=...)` uses this with one group per
    layer: all of a layer's gradients (kernel and bias) share one factor, so
    the direction of the layer's update is kept.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.
        groups: List of the same length as `gradients`: a hashable group key
            for each gradient (for instance the owning layer's name), or
            `None` to leave that gradient out of every group.
        clipnorm: Positive float. The largest joint L2 norm of a group.

    Returns:
        The list of clipped gradients.

    Raises:
        ValueError: If `groups` and `gradients` differ in length.

    Example:
    ```python
    >>> grads = clip_by_group_norm(
    ...     [tf.constant([3.0]), tf.constant([4.0]), tf.constant([9.0])],
    ...     ["a", "a", "b"], 1.0)
    >>> [round(float(g[0]), 3) for g in grads]
    [0.6, 0.8, 1.0]
    ```
    """
    if len(groups) != len(gradients):
        raise ValueError(
            "`groups` must have one entry per gradient. Received: "
            f"len(groups)={len(groups)}, len(gradients)={len(gradients)}. "
            "Pass a group key (or None) for every gradient."
        )
    gradients = [_gradient_ops.deduplicate(g) for g in gradients]
    members: dict[Hashable, list[int]] = {}
    for index, (g, key) in enumerate(zip(gradients, groups)):
        if g is not None and key is not None:
            members.setdefault(key, []).append(index)
    clipped = list(gradients)
    for indices in members.values():
        norm = global_norm([gradients[i] for i in indices])
        factor = _clip_factor(norm, clipnorm)
        for i in indices:
            clipped[i] = _scale(gradients[i], factor)
    return clipped


def unit_norms(tensor: Tensor) -> Tensor:
    """Returns the L2 norm of each unit of `tensor`, for adaptive clipping.

    A unit is a slice along the last axis (an output unit of a `Dense` or
    `Conv` kernel in Keras layout): the norm is taken over all other axes.
    A tensor of rank 0 or 1 is one unit.

    Args:
        tensor: A dense tensor.

    Returns:
        A float32 tensor broadcastable against `tensor`.

    Example:
    ```python
    >>> unit_norms(tf.constant([[3.0, 0.0], [4.0, 1.0]])).numpy()
    array([[5., 1.]], dtype=float32)
    ```
    """
    squares = ops.square(ops.cast(tensor, "float32"))
    rank = len(tensor.shape)
    if rank <= 1:
        return ops.sqrt(ops.sum(squares))
    return ops.sqrt(
        ops.sum(squares, axis=tuple(range(rank - 1)), keepdims=True)
    )


def adaptive_clip(
    gradients: Sequence[Gradient],
    variables: Sequence[Weight],
    clipping: float,
    eps: float = 1e-3,
) -> Gradients:
    """Unit-wise adaptive gradient clipping (AGC) of Brock et al. (2021).

    For each unit `i` (see `unit_norms`), with weights `W_i` and gradient
    `G_i`: if `||G_i|| > clipping * max(||W_i||, eps)`, then `G_i` is
    rescaled to that norm; otherwise it is kept. The bound grows with the
    weights, so large layers are not starved the way a fixed `clipnorm`
    starves them.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.
        variables: List of the same length: the variables (or tensors) the
            gradients belong to, with their current values.
        clipping: Positive float. The largest ratio of gradient norm to
            weight norm per unit (the paper uses 0.01 to 0.16).
        eps: Positive float. Floor on the weight norm, so units whose
            weights are zero can still move.

    Returns:
        The list of clipped gradients.

    Raises:
        ValueError: If `variables` and `gradients` differ in length.

    Example:
    ```python
    >>> w = tf.constant([[3.0], [4.0]])   # unit norm 5
    >>> g = tf.constant([[1.0], [0.0]])   # unit norm 1 > 0.1 * 5
    >>> adaptive_clip([g], [w], clipping=0.1)[0].numpy()
    array([[0.5],
           [0. ]], dtype=float32)
    ```

    References:
        - [Brock et al., 2021](https://arxiv.org/abs/2102.06171),
          "High-Performance Large-Scale Image Recognition Without
          Normalization".
    """
    if len(variables) != len(gradients):
        raise ValueError(
            "`variables` must have one entry per gradient. Received: "
            f"len(variables)={len(variables)}, "
            f"len(gradients)={len(gradients)}. Pass the variables in the "
            "same order as the gradients."
        )
    clipped: Gradients = []
    for g, variable in zip(gradients, variables):
        if g is None:
            clipped.append(None)
            continue
        g = _gradient_ops.deduplicate(g)
        weight_norm = unit_norms(ops.convert_to_tensor(variable))
        max_norm = clipping * ops.maximum(weight_norm, eps)

        def clip_values(values: Tensor, max_norm: Tensor = max_norm) -> Tensor:
            grad_norm = unit_norms(values)
            factor = max_norm / ops.maximum(
                grad_norm, _ADAPTIVE_GRADIENT_NORM_FLOOR
            )
            factor = ops.where(grad_norm > max_norm, factor, 1.0)
            return values * ops.cast(factor, values.dtype)

        clipped.append(_gradient_ops.map_values(clip_values, g))
    return clipped


def clip(
    gradients: Sequence[Gradient],
    variables: Sequence[Weight] | None = None,
    groups: Sequence[Hashable | None] | None = None,
    *,
    adaptive_clipping: float | None = None,
    adaptive_clipping_eps: float = 1e-3,
    clipvalue: float | None = None,
    clipnorm: float | None = None,
    group_clipnorm: float | None = None,
    global_clipnorm: float | None = None,
) -> Gradients:
    """Applies every requested kind of clipping, finest first.

    The order is: adaptive (per unit), `clipvalue` (per entry), `clipnorm`
    (per tensor), `group_clipnorm` (per group), `global_clipnorm` (all
    together). Each later step only scales gradients down, so every bound
    requested still holds on the result: no entry above `clipvalue`, no
    tensor norm above `clipnorm`, no group norm above `group_clipnorm`, and
    a global norm of at most `global_clipnorm`.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.
        variables: List aligned with `gradients`; needed for
            `adaptive_clipping` only.
        groups: List aligned with `gradients` of group keys (or `None`);
            needed for `group_clipnorm` only.
        adaptive_clipping: Positive float or `None`. See `adaptive_clip`.
        adaptive_clipping_eps: Positive float. See `adaptive_clip`.
        clipvalue: Positive float or `None`. See `clip_by_value`.
        clipnorm: Positive float or `None`. See `clip_by_norm`.
        group_clipnorm: Positive float or `None`. See `clip_by_group_norm`.
        global_clipnorm: Positive float or `None`. See
            `clip_by_global_norm`.

    Returns:
        The list of clipped gradients.

    Raises:
        ValueError: If `adaptive_clipping` is set without `variables`, or
            `group_clipnorm` without `groups`.

    Example:
    ```python
    >>> grads = clip([tf.constant([30.0, -4.0])], clipvalue=3.0,
    ...              global_clipnorm=1.0)
    >>> [round(float(v), 4) for v in grads[0]]
    [0.7071, -0.7071]
    ```
    """
    _require("variables", variables, "adaptive_clipping", adaptive_clipping)
    _require("groups", groups, "group_clipnorm", group_clipnorm)
    gradients = list(gradients)
    if adaptive_clipping is not None and variables is not None:
        gradients = adaptive_clip(
            gradients, variables, adaptive_clipping, adaptive_clipping_eps
        )
    if clipvalue is not None:
        gradients = clip_by_value(gradients, clipvalue)
    if clipnorm is not None:
        gradients = clip_by_norm(gradients, clipnorm)
    if group_clipnorm is not None and groups is not None:
        gradients = clip_by_group_norm(gradients, groups, group_clipnorm)
    if global_clipnorm is not None:
        gradients = clip_by_global_norm(gradients, global_clipnorm)
    return gradients


def _require(name: str, value: object, option: str, setting: object) -> None:
    """Raises if `option` is set but the list it needs, `name`, is not."""
    if setting is not None and value is None:
        raise ValueError(
            f"`{option}` needs `{name}`, aligned with the gradients. "
            f"Received: {option}={setting}, {name}=None. Pass {name}=... "
            "too."
        )
