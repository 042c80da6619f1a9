"""Element-wise helpers that treat dense and `tf.IndexedSlices` alike.

A gradient in a list may be a dense tensor, a `tf.IndexedSlices` (the
gradient of an `Embedding` or of `tf.gather`), or `None` (no gradient).
"""

from collections.abc import Callable

import tensorflow as tf

from custom_fit._types import Gradient


def map_values(
    function: Callable[[tf.Tensor], tf.Tensor], gradient: Gradient
) -> Gradient:
    """Applies `function` to the values of `gradient`.

    Args:
        function: Callable on a dense tensor, returning a tensor of the same
            shape.
        gradient: A tensor, a `tf.IndexedSlices`, or `None`.

    Returns:
        The result, of the same kind as `gradient`; `None` for `None`.
    """
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            function(gradient.values), gradient.indices, gradient.dense_shape
        )
    return function(gradient)


def deduplicate(gradient: Gradient) -> Gradient:
    """Sums the rows of an `IndexedSlices` that share an index.

    `tape.gradient` returns one row per lookup, so an index looked up twice
    appears twice. Norms and element-wise clipping must act on the summed
    row (the dense gradient), not on each part.

    Args:
        gradient: A tensor, a `tf.IndexedSlices`, or `None`.

    Returns:
        `gradient` unchanged unless it is a `tf.IndexedSlices`; then an
        equivalent `tf.IndexedSlices` whose indices are unique.
    """
    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    unique_indices, positions = tf.unique(gradient.indices)
    values = tf.math.unsorted_segment_sum(
        gradient.values, positions, tf.shape(unique_indices)[0]
    )
    return tf.IndexedSlices(values, unique_indices, gradient.dense_shape)


def values_of(gradient: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
    """Returns the tensor that holds the numbers of `gradient`.

    Args:
        gradient: A tensor or a `tf.IndexedSlices`.

    Returns:
        `gradient.values` for a `tf.IndexedSlices`, else `gradient`.
    """
    if isinstance(gradient, tf.IndexedSlices):
        return gradient.values
    return gradient


def squared_sum(gradient: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
    """Returns the sum of squares of the dense equivalent of `gradient`.

    Args:
        gradient: A tensor or a `tf.IndexedSlices`.

    Returns:
        A float32 scalar tensor.
    """
    values = tf.cast(values_of(deduplicate(gradient)), tf.float32)
    return tf.reduce_sum(tf.square(values))


def is_finite(gradient: tf.Tensor | tf.IndexedSlices) -> tf.Tensor:
    """Returns whether every entry of `gradient` is finite.

    Args:
        gradient: A tensor or a `tf.IndexedSlices`.

    Returns:
        A boolean scalar tensor.
    """
    return tf.reduce_all(tf.math.is_finite(values_of(gradient)))
