"""Type aliases used in the annotations of the public API.

They name what a value is without importing a backend: a tensor is the
backend's (a `tf.Tensor`, a `jax.Array`), and custom_fit works on every
backend Keras supports.
"""

from collections.abc import Callable
from typing import TYPE_CHECKING
from typing import Any
from typing import TypeAlias

import keras

# A tensor of the Keras backend in use.
Tensor: TypeAlias = Any

# One gradient of a list aligned with the variables: dense, sparse (on
# TensorFlow, the `tf.IndexedSlices` gradient of an `Embedding`), or `None`
# (no gradient).
Gradient: TypeAlias = Any
Gradients: TypeAlias = list[Gradient]

# A model variable.
Variable: TypeAlias = keras.Variable

# A weight as the pure functions read it: a variable or a tensor of values.
Weight: TypeAlias = Any

# A scalar: a rank-0 tensor or a Python number.
Scalar: TypeAlias = Any

# The logs of a step or an epoch: metric name to result.
Logs: TypeAlias = dict[str, Any]

Optimizer: TypeAlias = keras.optimizers.Optimizer

# Keras' train or test function.
StepFunction: TypeAlias = Callable[..., Any]

if TYPE_CHECKING:
    # The base of the classes a custom_fit model is made of, used before a
    # Keras model class: type checkers see its attributes through it; at
    # run time it is `object`.
    from keras import Model as ModelBase
else:
    ModelBase = object
