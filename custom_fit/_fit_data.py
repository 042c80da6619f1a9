"""What `fit` can tell of its data before the first step: batch counts.

Arrays are cut by Keras into batches of `batch_size` (32 by default),
after `validation_split` takes its share; a data object with a length
(a `PyDataset`, a `DataLoader`) has that many batches. Anything else
(a generator, a dataset of unknown cardinality) cannot be told.
"""

import math
from typing import Any

import keras
import numpy as np


def is_arrays(x: Any) -> bool:
    """Returns whether `x` is an array or a structure of arrays.

    Data objects (datasets, generators, `PyDataset`s) are not.
    """
    flat = keras.tree.flatten(x) if x is not None else []
    return bool(flat) and all(
        isinstance(item, np.ndarray) or hasattr(item, "__array__")
        for item in flat
    )


def array_examples(x: Any, validation_split: float | None = None) -> int:
    """The examples `fit` trains on from arrays `x`, after the split."""
    examples = int(np.shape(keras.tree.flatten(x)[0])[0])
    if validation_split:
        examples = int(math.floor(examples * (1.0 - validation_split)))
    return examples


def array_batches(examples: int, batch_size: int | None) -> tuple[int, int]:
    """Returns `(batch_size, batches)` of `examples` in Keras' batches.

    Keras' batches hold all the data when the batch size exceeds it.
    """
    size = min(batch_size or 32, examples)
    return size, -(-examples // max(size, 1))


def fit_batches(arguments: dict[str, Any]) -> dict[str, int | None]:
    """The training and validation batches per epoch of `fit`'s arguments.

    Validation is left out when `fit` validates on nothing.
    """
    x = arguments.get("x")
    batch_size = arguments.get("batch_size")
    split = arguments.get("validation_split") or 0.0
    counts = {
        "training": batches_per_epoch(
            x, batch_size, arguments.get("steps_per_epoch"), split
        )
    }
    validation = arguments.get("validation_data")
    validation_batch = arguments.get("validation_batch_size") or batch_size
    steps = arguments.get("validation_steps")
    if validation is not None:
        if isinstance(validation, tuple):
            validation = validation[0]
        counts["validation"] = batches_per_epoch(
            validation, validation_batch, steps
        )
    elif split and is_arrays(x):
        examples = array_examples(x) - array_examples(x, split)
        counts["validation"] = (
            steps or array_batches(examples, validation_batch)[1]
        )
    return counts


def batches_per_epoch(
    x: Any,
    batch_size: int | None = None,
    steps: int | None = None,
    validation_split: float | None = None,
) -> int | None:
    """The batches of one epoch over `x`, or `None` where it cannot be told.

    Args:
        x: `fit`'s (or `evaluate`'s) data.
        batch_size: `fit`'s `batch_size` (arrays only).
        steps: `steps_per_epoch` (or `validation_steps`), which wins.
        validation_split: `fit`'s `validation_split` (arrays only).
    """
    if steps is not None:
        return int(steps)
    if is_arrays(x):
        examples = array_examples(x, validation_split)
        return array_batches(examples, batch_size)[1]
    try:
        return len(x)  # type: ignore[arg-type]
    except TypeError:  # no length (a generator; unknown cardinality)
        return None
