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

__all__ = [
    "project_conflicting",
]


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
    specs = [(k, spec) for k, spec in enumerate(template) if spec is not None]
    # Per variable, the tasks' gradients stacked: (tasks, *shape). The dot
    # products and norms are sums of per-variable sums, never of one
    # flattened vector: under `keras.distribution.ModelParallel` a
    # concatenation of sharded gradients would gather them whole.
    stacked = [
        ops.stack([_dense_float32(task[k], shape) for task in task_gradients])
        for k, (shape, _) in specs
    ]
    squared = _gradient_ops.add_all(
        [_gradient_ops.squared_sums_per_slice(s) for s in stacked]
    )
    count = len(task_gradients)
    order = ops.convert_to_tensor(order, "int32")
    total: list[Tensor] = [ops.zeros_like(s[0]) for s in stacked]
    for i in range(count):
        g = [s[i] for s in stacked]
        for position in range(count):
            j = order[position]
            other = [ops.take(s, j, axis=0) for s in stacked]
            dot = _gradient_ops.add_all(
                [ops.sum(a * b) for a, b in zip(g, other)]
            )
            norm = ops.maximum(ops.take(squared, j), 1e-30)
            conflicts = ops.logical_and(dot < 0, j != i)
            g = [
                ops.where(conflicts, a - dot / norm * b, a)
                for a, b in zip(g, other)
            ]
        total = [t + a for t, a in zip(total, g)]
    update: Gradients = [None] * len(template)
    for (k, (_, dtype)), summed in zip(specs, total):
        update[k] = ops.cast(summed, dtype)
    return update


def _dense_float32(gradient: Gradient, shape: tuple[int, ...]) -> Tensor:
    """Returns a gradient as a dense float32 tensor (zeros for `None`)."""
    if gradient is None:
        return ops.zeros(shape, "float32")
    return ops.cast(_gradient_ops.dense(gradient), "float32")


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
