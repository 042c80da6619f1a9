"""Shared parts of the adapters of dense backends (JAX, PyTorch).

Their gradients are dense tensors; a step sees the global batch (JAX under
`keras.distribution` traces it over the global batch; Keras has no PyTorch
distribution yet), so there is one replica; a loss recorded on a tape is
TensorFlow's form only. See `_contract.Adapter` for each name.
"""

import contextlib
from collections.abc import Callable
from collections.abc import Iterable
from collections.abc import Sequence
from typing import Any

import keras
from keras import ops

# Numbers.


def squared_sums(gradients: Sequence[Any]) -> Any:
    """Returns each gradient's float32 sum of squares, as one vector."""
    return ops.stack(
        [ops.sum(ops.square(ops.cast(g, "float32"))) for g in gradients]
    )


def group_sums(values: Any, segments: Any, count: int) -> Any:
    """Returns the sum of `values` in each of `count` groups."""
    return ops.segment_sum(values, segments, count)


def scaled(gradients: Sequence[Any], factor: Any) -> list[Any]:
    """Returns each gradient times `factor`, in its own dtype."""
    return [g * ops.cast(factor, g.dtype) for g in gradients]


def normal(shape: Sequence[int], dtype: str, seeds: Any) -> Any:
    """Returns standard normal draws of `shape`, seeded from `seeds`.

    `seeds` is a `keras.random.SeedGenerator`, advanced by one draw.
    """
    return keras.random.normal(shape, dtype=dtype, seed=seeds)


def check_sampler(model: Any, sampler: Any) -> None:
    """Does nothing: each process feeds its share of one draw itself."""
    del model, sampler


def noisy(
    tensors: Sequence[Any],
    stddev: Any,
    seeds: Any,
    draw: Callable[[Sequence[int], str, Any], Any],
) -> list[Any]:
    """Returns `tensors` plus normal noise of `stddev`, one `draw` each.

    Under a compiler one draw per tensor costs no more than one split draw
    (measured on TensorFlow with XLA: a single draw split in six made the
    DP-SGD step of the seed MLP 1.67x plain Keras instead of 1.49x).
    """
    return [t + stddev * draw(t.shape, t.dtype, seeds) for t in tensors]


def add_noise(tensors: Sequence[Any], stddev: Any, seeds: Any) -> list[Any]:
    """Returns `tensors` plus normal noise: Keras' `random.normal` each."""
    return noisy(tensors, stddev, seeds, normal)


def dtype_groups(tensors: Sequence[Any]) -> list[list[int]]:
    """Returns the indices of `tensors`, grouped by dtype, in order."""
    groups: dict[Any, list[int]] = {}
    for index, tensor in enumerate(tensors):
        groups.setdefault(tensor.dtype, []).append(index)
    return list(groups.values())


def divisible_first_axis(tensor: Any, count: int, message: str) -> Any:
    """Returns `tensor`, checking that `count` divides its first axis.

    Shapes are static under `jax.jit` and in an eager step: a
    `ValueError(message)` is raised at trace time, or at once.
    """
    if tensor.shape[0] % count:
        raise ValueError(message)
    return tensor


def unaliased(value: Any) -> Any:
    """Returns `value`: a tensor here never changes in place."""
    return value


def add_to(variable: Any, values: Sequence[Any], where: Any = None) -> None:
    """Adds scalar `values` to the vector variable's entries, in one update."""
    added = ops.stack([ops.cast(v, "float32") for v in values])
    if where is not None:
        added = ops.where(where, added, ops.zeros_like(added))
    variable.assign_add(added)


# Replicas: one, whose gradients are the global batch's already.


def replica_count() -> int:
    """Returns 1: the step sees the global batch."""
    return 1


def all_reduce_sum(gradients: Sequence[Any]) -> list[Any]:
    """Returns the gradients: they are the global batch's already."""
    return list(gradients)


def batch_gradients(gradients: Sequence[Any]) -> list[Any]:
    """Returns the gradients: they are the global batch's already."""
    return list(gradients)


def summed_count(count: Any) -> Any:
    """Returns `count`: the step sees the global batch."""
    return count


def on_first_replica(value: Any) -> Any:
    """Returns `value`: there is one replica."""
    return value


# Losses recorded on a tape.


def check_recorded_loss(tape: Any) -> None:
    """A loss recorded on a tape is TensorFlow's; refused here."""
    del tape
    raise ValueError(
        "`minimize(loss, tape)` differentiates a loss recorded on a "
        "tf.GradientTape, which exists on the TensorFlow backend only. "
        f"Received: a loss tensor and a tape under KERAS_BACKEND="
        f"{keras.backend.backend()!r}. Pass a function of no arguments "
        "that computes the loss instead: "
        "`minimize(loss_function, optimizer=...)`."
    )


def recorded_gradients(tape: Any, value: Any, variables: Sequence[Any]) -> Any:
    """Refused, as `check_recorded_loss`."""
    del value, variables
    check_recorded_loss(tape)


# Sparse gradients do not occur.


def is_sparse(gradient: Any) -> bool:
    """Returns `False`: gradients are dense."""
    del gradient
    return False


def map_values(function: Callable[[Any], Any], gradient: Any) -> Any:
    """Applies `function` to `gradient`."""
    return function(gradient)


def deduplicate(gradient: Any) -> Any:
    """Returns `gradient`: dense gradients need no deduplication."""
    return gradient


def dense_size(gradient: Any) -> Any:
    """Returns the number of entries, as float32."""
    return ops.cast(ops.size(gradient), "float32")


def dense(gradient: Any) -> Any:
    """Returns `gradient`."""
    return gradient


# Every `compile` setting runs.


def check_compile(jit_compile: Any) -> None:
    """Accepts every `jit_compile`."""
    del jit_compile


# Keras' own build before `fit` and its logs work as they are.


def build_batch(model: Any, iterator: Iterable[Any]) -> Any:
    """Returns `None`: Keras builds from the first batch itself."""
    del model, iterator


def reducible_logs(model: Any, logs: dict[str, Any]) -> dict:
    """Returns `logs` unchanged."""
    del model
    return logs


class TrainerHooks:
    """No Keras trainer method needs overriding."""


def model_scope(model: Any) -> contextlib.AbstractContextManager:
    """Returns a context that does nothing: no strategy holds the model."""
    del model
    return contextlib.nullcontext()


def keras_at_least(version: tuple[int, int]) -> bool:
    """Whether the Keras in use is `version` (major, minor) or later."""
    found = tuple(int(part) for part in keras.version().split(".")[:2])
    return found >= version
