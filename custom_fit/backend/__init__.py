"""The seam between custom_fit's backend-neutral core and a Keras backend.

Everything custom_fit computes is written with `keras.ops` and Keras
variables, in the imperative style of a TensorFlow step. What differs per
backend lives in one adapter module each, selected by `KERAS_BACKEND` as
Keras selects its own (`keras/src/backend/<name>/trainer.py`):

- `custom_fit.backend.tensorflow`: the step runs statefully inside
  `tf.function`; gradients come from a `tf.GradientTape`; under
  `tf.distribute` they are summed across replicas, and conditional updates
  go through the strategy's `merge_call`.
- `custom_fit.backend.jax`: the step is stateless. The adapter builds the
  train and test functions itself: each call maps the model's state (the
  weights, the optimizer's, every metric's, custom_fit's own) into a
  `keras.StatelessScope`, runs the same imperative step inside it, and
  returns the new values; `jax.jit` compiles that function. Gradients come
  from `jax.value_and_grad` of a function of the differentiated variables.

Every adapter module defines the same functions (see `tensorflow.py` for
their documentation). A third backend (PyTorch) is one more module.
"""

import functools
import importlib
from types import ModuleType

import keras

SUPPORTED = ("tensorflow", "jax")


def name() -> str:
    """Returns the name of the Keras backend in use."""
    return keras.backend.backend()


def check_supported() -> None:
    """Raises if custom_fit cannot train on the Keras backend in use.

    Raises:
        ValueError: Naming the backend and the supported ones.
    """
    if name() not in SUPPORTED:
        raise ValueError(
            f"custom_fit does not support the Keras backend {name()!r}. "
            f"Received: KERAS_BACKEND={name()!r}. Supported backends: "
            f"{SUPPORTED}. Set the environment variable KERAS_BACKEND to one "
            "of them before importing Keras."
        )


@functools.cache
def _module(backend_name: str) -> ModuleType:
    return importlib.import_module(f"custom_fit.backend.{backend_name}")


def current() -> ModuleType:
    """Returns the adapter module of the Keras backend in use.

    Returns:
        `custom_fit.backend.tensorflow` or `custom_fit.backend.jax`.

    Raises:
        ValueError: If the backend is not supported.
    """
    check_supported()
    return _module(name())
