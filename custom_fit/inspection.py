"""Per-layer gradient statistics as pure functions.

Each function takes a list of gradients (tensors, `tf.IndexedSlices` or
`None`), a list of the same length naming the group (layer) of each
gradient, and the ordered list of groups to report; it returns a float32
vector with one entry per group. `IndexedSlices` count as their dense
equivalent. Groups without any gradient report 0.

```python
norms = group_norms(grads, model_layer_names, ["dense", "dense_1"])
```
"""

from collections.abc import Callable
from collections.abc import Hashable
from collections.abc import Sequence

from keras import ops

from custom_fit import _gradient_ops
from custom_fit._types import Gradient
from custom_fit._types import Tensor
from custom_fit._types import Weight

__all__ = [
    "STATISTICS",
    "group_max_abs",
    "group_nonfinite_count",
    "group_norms",
    "group_squared_norms",
    "group_zero_fraction",
    "update_ratios",
]


# Statistics that `GradientInspectionMixin(gradient_statistics=...)` offers
# beside the per-layer norm.
STATISTICS = ("max_abs", "zero_fraction", "nonfinite_count", "update_ratio")

# Floor on a weight norm in `update_ratios`, so zero weights do not divide by 0.
_WEIGHT_NORM_FLOOR = 1e-12


def _per_group(
    values: Sequence[Tensor | None],
    groups: Sequence[Hashable],
    order: Sequence[Hashable],
    combine: Callable[..., Tensor],
) -> Tensor:
    """Combines per-gradient scalars into one value per group in `order`.

    A sum is one `add_n` per group (a group of one costs nothing); other
    reductions stack the group's values first.
    """
    members: dict[Hashable, list[Tensor]] = {key: [] for key in order}
    for value, key in zip(values, groups):
        if value is not None and key in members:
            members[key].append(value)

    def combined(items: list[Tensor]) -> Tensor:
        if not items:
            return ops.convert_to_tensor(0.0, "float32")
        if combine is ops.sum:
            return _gradient_ops.add_all(items)
        return combine(ops.stack(items))

    return ops.stack([combined(items) for items in members.values()])


def group_norms(
    gradients: Sequence[Gradient],
    groups: Sequence[Hashable],
    order: Sequence[Hashable],
) -> Tensor:
    """Returns the joint L2 norm of each group's gradients.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.
        groups: List aligned with `gradients`: the group of each gradient.
        order: List of the groups to report, in order.

    Returns:
        A float32 vector of `len(order)` norms.

    Example:

    ```python
    >>> g = [tf.constant([3.0]), tf.constant([4.0]), tf.constant([1.0])]
    >>> group_norms(g, ["a", "a", "b"], ["a", "b"]).numpy()
    array([5., 1.], dtype=float32)
    ```
    """
    return ops.sqrt(group_squared_norms(gradients, groups, order))


def group_squared_norms(
    gradients: Sequence[Gradient],
    groups: Sequence[Hashable],
    order: Sequence[Hashable],
) -> Tensor:
    """Returns the sum of squared gradient entries of each group.

    The squares of `group_norms`; their sum is the squared global norm, so
    one pass over the gradients gives both the per-layer and the global
    figure.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.
        groups: List aligned with `gradients`: the group of each gradient.
        order: List of the groups to report, in order.

    Returns:
        A float32 vector of `len(order)` sums of squares.

    Example:

    ```python
    >>> g = [tf.constant([3.0]), tf.constant([4.0]), tf.constant([1.0])]
    >>> group_squared_norms(g, ["a", "a", "b"], ["a", "b"]).numpy()
    array([25., 1.], dtype=float32)
    ```
    """
    squares = [
        None if g is None else _gradient_ops.squared_sum(g) for g in gradients
    ]
    return _per_group(squares, groups, order, ops.sum)


def group_max_abs(
    gradients: Sequence[Gradient],
    groups: Sequence[Hashable],
    order: Sequence[Hashable],
) -> Tensor:
    """Returns the largest absolute gradient entry of each group.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.
        groups: List aligned with `gradients`: the group of each gradient.
        order: List of the groups to report, in order.

    Returns:
        A float32 vector of `len(order)` values (NaN if a NaN is present).

    Example:

    ```python
    >>> group_max_abs([tf.constant([-3.0, 2.0])], ["a"], ["a"]).numpy()
    array([3.], dtype=float32)
    ```
    """
    maxima = [
        None
        if g is None
        else ops.max(
            ops.abs(
                ops.cast(
                    _gradient_ops.values_of(_gradient_ops.deduplicate(g)),
                    "float32",
                )
            )
        )
        for g in gradients
    ]
    return _per_group(maxima, groups, order, ops.max)


def group_zero_fraction(
    gradients: Sequence[Gradient],
    groups: Sequence[Hashable],
    order: Sequence[Hashable],
) -> Tensor:
    """Returns the fraction of exactly-zero gradient entries of each group.

    A high fraction flags dead units (a ReLU that never fires passes back
    exact zeros).

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.
        groups: List aligned with `gradients`: the group of each gradient.
        order: List of the groups to report, in order.

    Returns:
        A float32 vector of `len(order)` fractions in [0, 1].

    Example:

    ```python
    >>> group_zero_fraction([tf.constant([0.0, 2.0, 0.0, 1.0])], ["a"],
    ...                     ["a"]).numpy()
    array([0.5], dtype=float32)
    ```
    """
    zeros: list[Tensor | None] = []
    sizes: list[Tensor | None] = []
    for g in gradients:
        if g is None:
            zeros.append(None)
            sizes.append(None)
            continue
        g = _gradient_ops.deduplicate(g)
        size = _gradient_ops.dense_size(g)
        # Not `ops.count_nonzero`: on PyTorch, Keras' version warns.
        nonzero = ops.sum(
            ops.cast(ops.not_equal(_gradient_ops.values_of(g), 0), "float32")
        )
        zeros.append(size - nonzero)
        sizes.append(size)
    zero_counts = _per_group(zeros, groups, order, ops.sum)
    total_sizes = _per_group(sizes, groups, order, ops.sum)
    return ops.divide_no_nan(zero_counts, total_sizes)


def group_nonfinite_count(
    gradients: Sequence[Gradient],
    groups: Sequence[Hashable],
    order: Sequence[Hashable],
) -> Tensor:
    """Returns the number of NaN or infinite gradient entries of each group.

    Args:
        gradients: List of tensors, `tf.IndexedSlices` or `None`.
        groups: List aligned with `gradients`: the group of each gradient.
        order: List of the groups to report, in order.

    Returns:
        A float32 vector of `len(order)` counts.

    Example:

    ```python
    >>> group_nonfinite_count([tf.constant([1.0, float("nan")])], ["a"],
    ...                       ["a"]).numpy()
    array([1.], dtype=float32)
    ```
    """
    counts = [
        None
        if g is None
        else ops.sum(
            ops.cast(
                ops.logical_not(ops.isfinite(_gradient_ops.values_of(g))),
                "float32",
            )
        )
        for g in gradients
    ]
    return _per_group(counts, groups, order, ops.sum)


def update_ratios(
    before: Sequence[Weight],
    after: Sequence[Weight],
    groups: Sequence[Hashable],
    order: Sequence[Hashable],
) -> Tensor:
    """Returns, per group, the norm of the update over the norm of the weights.

    The ratio `||w_after - w_before|| / ||w_before||` is the usual check on a
    learning rate: around 1e-3 is healthy, much larger means the weights are
    rewritten every step, much smaller that the layer barely learns.

    Args:
        before: List of weight tensors before the optimizer step.
        after: List of the same weights after the step.
        groups: List aligned with `before`: the group of each weight.
        order: List of the groups to report, in order.

    Returns:
        A float32 vector of `len(order)` ratios.

    Example:

    ```python
    >>> update_ratios([tf.constant([3.0, 4.0])], [tf.constant([3.0, 4.5])],
    ...               ["a"], ["a"]).numpy()
    array([0.1], dtype=float32)
    ```
    """
    updates = [
        ops.sum(ops.square(ops.cast(a, "float32") - ops.cast(b, "float32")))
        for a, b in zip(after, before)
    ]
    weights = [ops.sum(ops.square(ops.cast(b, "float32"))) for b in before]
    update_norms = ops.sqrt(_per_group(updates, groups, order, ops.sum))
    weight_norms = ops.sqrt(_per_group(weights, groups, order, ops.sum))
    return update_norms / ops.maximum(weight_norms, _WEIGHT_NORM_FLOOR)


GROUP_STATISTICS: dict[str, Callable[..., Tensor]] = {
    "norm": group_norms,
    "max_abs": group_max_abs,
    "zero_fraction": group_zero_fraction,
    "nonfinite_count": group_nonfinite_count,
}
