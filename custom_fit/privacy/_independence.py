"""Whether a model keeps a batch's examples apart, tried on a real batch.

DP-SGD bounds each example's influence by clipping its gradient, which
holds only where an example's loss depends on that example alone, and
where training writes no state computed from the data that the noise does
not cover. Ghost clipping (`custom_fit.per_example.ghost_clipped_sums`)
assumes the first of the whole model, and no class list can vouch for a
custom layer (`h - mean(h, axis=0)`), a Keras layer called with `axis=0`
or a loss that reduces over the batch. So `DifferentialPrivacyMixin.fit`
tries the model before its first step, on the first batch of its data:

- independence: the batch, and the batch with its first example replaced
  by another of its examples, run through the model in training mode from
  the same state (the same dropout draws); every other example's outputs
  and compiled losses must not move (`mixing`);
- state: the non-trainable variables the two passes write must not
  differ: a variable that does (a BatchNormalization's moving statistics,
  at any depth) carries the data, noise-free (`leaks`).

Both passes are `stateless_call`s (compiled once on JAX, whose eager
operations compile one by one): the model's variables are left as they
were. The check proves what it sees (a forward pass, one batch); code that
hides the mixing from the forward pass (a `stop_gradient` that keeps the
values and mixes only the gradient) it cannot see.
"""

import dataclasses
from typing import Any

import keras
import numpy as np

from custom_fit import _fit_data
from custom_fit import _keras_compat
from custom_fit import backend

# Outputs and losses may move by this share of their scale, no more: two
# passes of the same shapes compute each example with the same operations.
_TOLERANCE = 1e-6
# The examples tried: a batch mean over n rows moves each row by about
# 1 / n of the change, which a few rows keep far above the tolerance (a
# running mean with momentum 0.999 over 256 rows moved by less).
_ROWS = 4


@dataclasses.dataclass(frozen=True)
class Probe:
    """What trying a model on a batch showed.

    Attributes:
        checked: Bool. Whether a batch of at least two different examples
            could be tried (else nothing was shown).
        mixing: String, `""` or a sentence saying which example's output
            or loss moved when another example changed.
        leaks: String, `""` or a sentence naming the non-trainable
            variables whose training-mode update depends on the data.
    """

    checked: bool
    mixing: str = ""
    leaks: str = ""


def first_batch(arguments: dict[str, Any]) -> tuple[Any, Any, Any] | None:
    """Returns `fit`'s first batch without taking it, or `None`.

    Arrays give their first rows; a `PyDataset` (a `PoissonSampler`: a
    draw is a pure function of its index) its item 0; a `tf.data.Dataset`
    or a `DataLoader` the first element of a new iterator; each cut to its
    first `_ROWS` examples. A generator, which cannot be read twice, gives
    `None`.

    Args:
        arguments: `fit`'s arguments, by name.

    Returns:
        `(x, y, sample_weight)` as NumPy arrays (nested), or `None`.
    """
    x: Any = arguments.get("x")
    if _fit_data.is_arrays(x):
        item: Any = (x, arguments.get("y"), arguments.get("sample_weight"))
    elif isinstance(x, keras.utils.PyDataset):
        item = x[0]
    elif hasattr(x, "element_spec") and hasattr(x, "take"):
        item = next(iter(x.take(1)))
    elif hasattr(x, "__iter__") and hasattr(x, "__len__"):
        item = next(iter(x))
    else:
        return None

    def head(value: Any) -> Any:
        return np.asarray(keras.ops.convert_to_numpy(value))[:_ROWS]

    item = keras.tree.map_structure(
        lambda value: None if value is None else head(value), item
    )
    if isinstance(item, tuple) and len(item) == 3:
        return item
    return keras.utils.unpack_x_y_sample_weight(item)


def probe(model: Any, batch: tuple[Any, Any, Any]) -> Probe:
    """Tries `model` in training mode on `batch` and on a changed copy.

    Args:
        model: A built (or buildable), compiled model.
        batch: `(x, y, sample_weight)`, as `first_batch` returns.

    Returns:
        A `Probe`.
    """
    x, y, _ = batch
    leaves = [np.asarray(t) for t in keras.tree.flatten(x)]
    size = len(leaves[0]) if leaves and leaves[0].ndim else 0
    other = _most_different(leaves, size)
    if other is None:
        return Probe(checked=False)

    def changed(value: Any) -> Any:
        value = np.array(value, copy=True)
        value[0] = value[other]
        return value

    if not model.built:
        model(x, training=False)
    _keras_compat.build_compiled_loss(model, x, y)
    adapter = backend.current()
    trainable = adapter.local_values(model.trainable_variables)
    non_trainable = adapter.local_values(model.non_trainable_variables)

    def training_pass(x: Any, y: Any) -> tuple[Any, Any, Any]:
        y_pred, state = model.stateless_call(
            trainable, non_trainable, x, training=True
        )
        losses = dict(_keras_compat.example_loss_values(model, y, y_pred))
        return keras.tree.flatten(y_pred), losses, state

    run = adapter.compiled(training_pass)
    first = _numpy(run(x, y))
    second = _numpy(
        run(
            keras.tree.map_structure(changed, x),
            keras.tree.map_structure(changed, y),
        )
    )
    return Probe(
        checked=True,
        mixing=_moved_rows(first, second, size),
        leaks=_moved_state(model, first, second),
    )


def _most_different(leaves: list[np.ndarray], size: int) -> int | None:
    """The example that differs most from example 0, `None` for none."""
    if size < 2:
        return None
    distance = np.zeros(size)
    for leaf in leaves:
        flat = leaf.reshape(size, -1)
        if not np.issubdtype(flat.dtype, np.number):
            # Text and other objects: how many entries differ.
            distance += (flat != flat[:1]).sum(axis=1)
            continue
        # A NaN or an Inf differs from anything.
        apart = np.abs(flat.astype(np.float64) - flat[:1].astype(np.float64))
        distance += np.where(np.isfinite(apart), apart, 1.0).sum(axis=1)
    best = int(np.argmax(distance))
    return best if distance[best] > 0 else None


@dataclasses.dataclass
class _Pass:
    """The outputs, compiled losses and written state of one pass."""

    outputs: list[np.ndarray]
    losses: list[tuple[str, np.ndarray]]
    state: list[np.ndarray]


def _numpy(found: tuple[Any, Any, Any]) -> _Pass:
    """A pass's outputs, compiled losses and written state, on the host."""
    outputs, losses, state = found
    numpy = keras.ops.convert_to_numpy
    return _Pass(
        outputs=[numpy(t) for t in outputs],
        losses=[(name, numpy(values)) for name, values in losses.items()],
        state=[numpy(t) for t in state],
    )


def _moved(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether `b` differs from `a` beyond rounding."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = max(1.0, float(np.nanmax(np.abs(a), initial=0.0)))
    return bool(np.nanmax(np.abs(a - b), initial=0.0) > _TOLERANCE * scale)


def _moved_rows(first: _Pass, second: _Pass, size: int) -> str:
    """Says which other example's output or loss moved, or `""`."""
    for index, (a, b) in enumerate(zip(first.outputs, second.outputs)):
        if a.ndim == 0 or a.shape[0] != size:
            return (
                f"the model's output {index} has no row per example "
                f"(shape {a.shape} for a batch of {size})"
            )
        if _moved(a[1:], b[1:]):
            return (
                "changing one example of a batch moved the model's outputs "
                "for other examples: a layer mixes the examples (batch "
                "statistics, a mean or a normalization over the batch axis)"
            )
    for (name, a), (_, b) in zip(first.losses, second.losses):
        if a.ndim == 0 or a.shape[0] != size:
            return (
                f"the loss of the output {name!r} gives no value per example "
                f"(shape {a.shape} for a batch of {size}): it reduces over "
                "the batch"
            )
        if _moved(a[1:], b[1:]):
            return (
                f"changing one example of a batch moved the loss of the "
                f"output {name!r} for other examples: it mixes the examples "
                "(an axis of 0, a reduction over the batch)"
            )
    return ""


def _moved_state(model: Any, first: _Pass, second: _Pass) -> str:
    """Names the non-trainable variables whose update follows the data."""
    moved = [
        variable.path
        for variable, a, b in zip(
            model.non_trainable_variables, first.state, second.state
        )
        if _moved(a, b)
    ]
    if not moved:
        return ""
    shown = ", ".join(repr(path) for path in moved[:4])
    more = f" and {len(moved) - 4} more" if len(moved) > 4 else ""
    layers = dict.fromkeys(path.rpartition("/")[0] for path in moved)
    named = ", ".join(repr(layer) for layer in layers)
    return f"{shown}{more} (of the layers {named})"
