"""Type aliases used in the annotations of the public API."""

from collections.abc import Callable
from typing import Any
from typing import TypeAlias

import keras
import tensorflow as tf

# One gradient of a list aligned with the variables: dense, sparse (the
# gradient of an `Embedding` or of `tf.gather`), or `None` (no gradient).
Gradient: TypeAlias = tf.Tensor | tf.IndexedSlices | None
Gradients: TypeAlias = list[Gradient]

# A model variable: Keras 3 wraps a `tf.Variable` in its own class.
Variable: TypeAlias = keras.Variable | tf.Variable

# A weight as the pure functions read it: a variable or a tensor of values.
Weight: TypeAlias = keras.Variable | tf.Variable | tf.Tensor

# A scalar: a rank-0 tensor or a Python number.
Scalar: TypeAlias = tf.Tensor | float

# The logs of a step or an epoch: metric name to result.
Logs: TypeAlias = dict[str, Any]

Optimizer: TypeAlias = keras.optimizers.Optimizer

# Keras' train or test function: called on the data iterator, returns the
# logs.
StepFunction: TypeAlias = Callable[[Any], Logs]
