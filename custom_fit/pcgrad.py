"""PCGrad (gradient surgery) as a pure function on task gradients.

Yu et al. 2020, "Gradient Surgery for Multi-Task Learning": each task's
gradient, flattened over all variables, is projected onto the normal plane
of every other task's gradient it conflicts with (negative dot product),
taking the other tasks in a random order and projecting against their
original gradients; the update is the sum of the projected gradients.

```python
update = custom_fit.pcgrad.project_conflicting(
    [gradients_of_task_a, gradients_of_task_b], order=[0, 1]
)
```
"""

from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

from custom_fit import _gradient_ops
from custom_fit._types import Gradient
from custom_fit._types import Gradients
from custom_fit._types import Tensor


def project_conflicting(
    task_gradients: Sequence[Sequence[Gradient]], order: Any
) -> Gradients:
    """Returns the PCGrad update: the sum of the projected task gradients.

    For each task `i`, `g = g_i`; then for each other task `j` in `order`
    (the same order for every `i`, `j = i` skipped), if `g . g_j < 0`,
    `g = g - (g . g_j) / ||g_j||^2 g_j` (projected against `g_j`, the
    original gradient of task `j`). The result is the sum over tasks of
    `g`, split back per variable.

    Args:
        task_gradients: List, one entry per task, of gradient lists aligned
            with the variables (`None` counts as zeros; a variable with no
            gradient in any task keeps `None`).
        order: Sequence or integer tensor: a permutation of the task
            indices.

    Returns:
        A list of gradients aligned with the variables.

    Example:

    ```python
    >>> a = [np.array([1.0, 0.0])]
    >>> b = [np.array([-1.0, 1.0])]
    >>> [np.round(ops.convert_to_numpy(g), 3) for g in
    ...  project_conflicting([a, b], order=[0, 1])]
    [array([0.5, 1.5])]
    ```
    """
    template = _shapes(task_gradients)
    flat = ops.stack(
        [_flattened(gradients, template) for gradients in task_gradients]
    )
    count = len(task_gradients)
    order = ops.convert_to_tensor(order, "int32")
    projected = []
    for i in range(count):
        g = flat[i]
        for position in range(count):
            other = ops.take(flat, order[position], axis=0)
            dot = ops.sum(g * other)
            squared = ops.maximum(ops.sum(other * other), 1e-30)
            conflicts = ops.logical_and(dot < 0, order[position] != i)
            g = ops.where(conflicts, g - dot / squared * other, g)
        projected.append(g)
    return _split(_gradient_ops.add_all(projected), template)


def _shapes(
    task_gradients: Sequence[Sequence[Gradient]],
) -> list[tuple[tuple[int, ...], str] | None]:
    """Returns, per variable, the shape and dtype of its gradient, or None."""
    template: list[tuple[tuple[int, ...], str] | None] = []
    for column in zip(*task_gradients):
        present = [g for g in column if g is not None]
        if not present:
            template.append(None)
            continue
        dense = _gradient_ops.dense(present[0])
        dtype = keras.backend.standardize_dtype(dense.dtype)
        template.append((tuple(dense.shape), dtype))
    return template


def _flattened(
    gradients: Sequence[Gradient],
    template: list[tuple[tuple[int, ...], str] | None],
) -> Tensor:
    """Returns one task's gradients as one float32 vector."""
    parts = []
    for gradient, spec in zip(gradients, template):
        if spec is None:
            continue
        shape, _ = spec
        if gradient is None:
            parts.append(ops.zeros((_size(shape),), "float32"))
        else:
            dense = ops.cast(_gradient_ops.dense(gradient), "float32")
            parts.append(ops.reshape(dense, (-1,)))
    return ops.concatenate(parts)


def _split(
    vector: Tensor, template: list[tuple[tuple[int, ...], str] | None]
) -> Gradients:
    """Splits a flat vector back into gradients of the template's shapes."""
    gradients: Gradients = []
    start = 0
    for spec in template:
        if spec is None:
            gradients.append(None)
            continue
        shape, dtype = spec
        size = _size(shape)
        piece = ops.reshape(vector[start : start + size], shape)
        gradients.append(ops.cast(piece, dtype))
        start += size
    return gradients


def _size(shape: tuple[int, ...]) -> int:
    """Returns the number of entries of a static shape."""
    size = 1
    for dim in shape:
        size *= int(dim)
    return size
