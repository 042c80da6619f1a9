"""Shared parts of the adapters whose `fit` sees the global data (TF, JAX).

`tf.distribute` and `keras.distribution` feed the step the global batch
(or shard it themselves), so there are no per-process shares to compare,
no per-process metric states to sum, and Keras compiles the whole step,
forward pass included. See `_contract.Adapter` for each name; PyTorch's
counterparts are in `_torch_processes` and `_torch_compile`.
"""

from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import numpy as np


def summed_results(metrics: Sequence[Any], compute: Callable[[], Any]) -> Any:
    """Returns `compute()`: the metric states are the global batch's."""
    del metrics
    return compute()


def data_shards() -> tuple[int, int]:
    """Returns `(1, 0)`: `fit`'s data in each process is the global data."""
    return 1, 0


def gather_from_processes(values: Sequence[int]) -> np.ndarray:
    """Returns `values` as the only row: one process feeds `fit`."""
    return np.asarray([list(values)], np.int64)


def forward(
    model: Any, call: Callable[..., Any], x: Any, training: bool
) -> Any:
    """Returns `call(model, x, training=training)`.

    Keras compiles the whole step (`tf.function`, XLA, `jax.jit`) with its
    forward pass.
    """
    return call(model, x, training=training)
