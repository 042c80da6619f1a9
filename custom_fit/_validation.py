"""Argument checks that raise Keras-worded `ValueError`s.

Every message names the argument, shows the value received and ends with
the fix. The checks run in `__init__` (and when a model is rebuilt from its
config), never inside the training step.
"""

import math
import numbers
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorflow as tf


def positive_float_or_none(name: str, value: Any) -> float | None:
    """Returns `value` as a float, or `None`, after checking it.

    Args:
        name: String. The argument's name, used in the error message.
        value: The value received.

    Returns:
        `None`, or `value` as a Python float.

    Raises:
        ValueError: If `value` is not `None` and is not a finite number
            greater than zero (bools and strings are rejected too).
    """
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Real)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(
            f"`{name}` must be a finite float greater than 0, or None to "
            f"turn it off. Received: {name}={value!r}. Pass a positive "
            f"number such as {name}=1.0, or {name}=None."
        )
    return float(value)


def positive_float(name: str, value: Any) -> float:
    """Returns `value` as a float after checking it; `None` is refused.

    Args:
        name: String. The argument's name, used in the error message.
        value: The value received.

    Returns:
        `value` as a Python float.

    Raises:
        ValueError: If `value` is not a finite number greater than zero.
    """
    if value is None:
        raise ValueError(
            f"`{name}` must be a finite float greater than 0. "
            f"Received: {name}=None. Pass a positive number."
        )
    return positive_float_or_none(name, value)


def positive_int_or_none(name: str, value: Any) -> int | None:
    """Returns `value` as an int, or `None`, after checking it.

    Args:
        name: String. The argument's name, used in the error message.
        value: The value received.

    Returns:
        `None`, or `value` as a Python int.

    Raises:
        ValueError: If `value` is not `None` and is not an integer >= 1.
    """
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < 1
    ):
        raise ValueError(
            f"`{name}` must be an integer >= 1, or None for no limit. "
            f"Received: {name}={value!r}. Pass for example {name}=10."
        )
    return int(value)


def boolean(name: str, value: Any) -> bool:
    """Returns `value` after checking that it is a bool.

    Args:
        name: String. The argument's name, used in the error message.
        value: The value received.

    Returns:
        `value`, a Python bool.

    Raises:
        ValueError: If `value` is not `True` or `False` (a NumPy bool is
            accepted).
    """
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(
            f"`{name}` must be True or False. Received: {name}={value!r}. "
            f"Pass {name}=True or {name}=False."
        )
    return bool(value)


def names_or_none(name: str, value: Any) -> tuple[str, ...] | None:
    """Returns `value` as a tuple of names (layers, variables), or `None`.

    Args:
        name: String. The argument's name, used in the error message.
        value: `None`, or a list or tuple of strings.

    Returns:
        `None`, or a tuple of strings.

    Raises:
        ValueError: If `value` is a bare string, is not a list or tuple, is
            empty, or holds something other than non-empty strings.
    """
    if value is None:
        return None
    if (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(item, str) and item for item in value)
    ):
        return tuple(value)
    raise ValueError(
        f"`{name}` must be a non-empty list of names, or None for the "
        f"default. Received: {name}={value!r}. Pass a list of strings, even "
        f"for one name: for example {name}=['dense_1']."
    )


def one_of(allowed: tuple[str, ...]) -> Callable[[str, Any], str]:
    """Returns a validator accepting only the strings in `allowed`.

    Args:
        allowed: Tuple of the allowed strings.

    Returns:
        A callable `(name, value) -> value` that raises `ValueError`, listing
        `allowed`, for any other value.
    """

    def validate(name: str, value: Any) -> str:
        if value not in allowed:
            raise ValueError(
                f"`{name}` must be one of {allowed}. Received: "
                f"{name}={value!r}. Pass one of the allowed values."
            )
        return value

    return validate


def subset_of(
    allowed: tuple[str, ...],
) -> Callable[[str, Any], tuple[str, ...]]:
    """Returns a validator accepting a list or tuple of strings in `allowed`.

    Args:
        allowed: Tuple of the allowed strings.

    Returns:
        A callable `(name, value) -> tuple` that raises `ValueError`, listing
        `allowed`, for anything else.
    """

    def validate(name: str, value: Any) -> tuple[str, ...]:
        if isinstance(value, (list, tuple)) and all(
            item in allowed for item in value
        ):
            return tuple(dict.fromkeys(value))
        raise ValueError(
            f"`{name}` must be a list of names from {allowed}. Received: "
            f"{name}={value!r}. Pass for example {name}=[{allowed[0]!r}]."
        )

    return validate


def scalar_tensor(value: Any, what: str, name: str) -> tf.Tensor:
    """Returns `value` as a tensor after checking that it is a numeric scalar.

    Runs at trace time, where static shapes are known.

    Args:
        value: A tensor or a Python number.
        what: String. What the value is, for the message ("The metric").
        name: String. The value's name, for the message.

    Returns:
        A tensor of rank 0 with a floating-point or integer dtype.

    Raises:
        ValueError: If `value` cannot be converted to a tensor (`None`, an
            object), has a dtype other than floating point or integer
            (strings, bools), or has a rank other than 0.
    """
    try:
        tensor = tf.convert_to_tensor(value)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"{what} {name!r} must be a number or a scalar tensor. "
            f"Received: {name}={value!r} of type {type(value).__name__}. "
            "Return a scalar tensor, for instance with `ops.mean`."
        ) from error
    if not (tensor.dtype.is_floating or tensor.dtype.is_integer):
        raise ValueError(
            f"{what} {name!r} must have a floating-point or integer dtype. "
            f"Received: {name}={value!r} of dtype {tensor.dtype.name}. "
            "Return a numeric scalar, for instance with `ops.mean`."
        )
    if tensor.shape.rank != 0:
        raise ValueError(
            f"{what} {name!r} must be a scalar. Received: {name}=<tensor of "
            f"shape {tensor.shape}>. Reduce it to a scalar first, for instance "
            "with `ops.mean`."
        )
    return tensor
