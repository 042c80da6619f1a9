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

Every adapter module defines exactly the functions of the contract,
`custom_fit.backend.Adapter` (`_contract.py`, with their meaning), and the
core calls them through `current()` only; dense backends share the
defaults of `_dense.py`. A backend is one module.
"""

import functools
import importlib
from types import ModuleType

import keras

from custom_fit.backend._contract import Adapter

SUPPORTED = ("tensorflow", "jax", "torch")


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


def current() -> Adapter:
    """Returns the adapter module of the Keras backend in use.

    Returns:
        The module of `custom_fit.backend` named as the backend.

    Raises:
        ValueError: If the backend is not supported.
    """
    backend_name = name()
    if backend_name not in SUPPORTED:
        check_supported()
    # Called many times per eager step: one lookup, no second check.
    adapter: Adapter = _module(backend_name)  # type: ignore[assignment]
    return adapter


def trainer_hooks() -> type:
    """Returns the class of Keras trainer methods the backend overrides.

    Mixed into `TrainStepMixin` when custom_fit is imported; under a
    backend custom_fit does not support, a class with none (the model is
    refused when it is built).
    """
    if name() not in SUPPORTED:
        return type("TrainerHooks", (), {})
    return current().TrainerHooks
