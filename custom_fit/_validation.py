"""Argument checks that raise Keras-worded `ValueError`s.

Every message names the argument, shows the value received and ends with
the fix. The checks run in `__init__` (and when a model is rebuilt from its
config), never inside the training step.
"""

import math
import numbers
from collections.abc import Callable
from collections.abc import Collection
from typing import Any

import keras
import numpy as np
from keras import ops

# The largest integer option accepted: counters and step numbers are int32
# on some backends (JAX without x64), and `%` by a larger number overflows.
MAX_INT = 2**31 - 1


def shown(value: Any) -> str:
    """Returns `repr(value)`, shortened for integers of many digits."""
    text = repr(value)
    if isinstance(value, numbers.Integral) and len(text) > 24:
        return f"{text[:12]}...<{len(text)} digits>"
    return text


def _as_finite_float(value: Any) -> float | None:
    """Returns `value` as a finite float, or `None` if it is not one.

    Bools, strings and other non-numbers give `None`, and so do integers
    too large for a float (which raise `OverflowError` in `float()`).
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, numbers.Real
    ):
        return None
    try:
        number = float(value)
    except (OverflowError, ValueError, TypeError):
        return None
    return number if math.isfinite(number) else None


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
    number = _as_finite_float(value)
    if number is None or number <= 0:
        raise ValueError(
            f"`{name}` must be a finite float greater than 0, or None to "
            f"turn it off. Received: {name}={shown(value)}. Pass a positive "
            f"number such as {name}=1.0, or {name}=None."
        )
    return number


def float_above_one_or_none(name: str, value: Any) -> float | None:
    """Returns `value` as a float greater than 1, or `None`.

    Args:
        name: String. The argument's name, used in the error message.
        value: The value received.

    Returns:
        `None`, or `value` as a Python float.

    Raises:
        ValueError: If `value` is not `None` and not a finite number
            greater than 1.
    """
    if value is None:
        return None
    number = _as_finite_float(value)
    if number is None or number <= 1:
        raise ValueError(
            f"`{name}` must be a finite float greater than 1 (a ratio to "
            f"the running average), or None to turn it off. Received: "
            f"{name}={shown(value)}. Pass for example {name}=5.0."
        )
    return number


def fraction(name: str, value: Any) -> float:
    """Returns `value` as a float strictly between 0 and 1.

    Args:
        name: String. The argument's name, used in the error message.
        value: The value received.

    Returns:
        `value` as a Python float.

    Raises:
        ValueError: If `value` is not a number in the open interval (0, 1).
    """
    number = _as_finite_float(value)
    if number is None or not 0 < number < 1:
        raise ValueError(
            f"`{name}` must be a float between 0 and 1 (both excluded). "
            f"Received: {name}={shown(value)}. Pass for example "
            f"{name}=0.99."
        )
    return number


def is_schedule(value: Any) -> bool:
    """Returns whether `value` is a Keras schedule (`LearningRateSchedule`)."""
    return isinstance(value, keras.optimizers.schedules.LearningRateSchedule)


def representable(name: str, value: float | None, dtype: str) -> None:
    """Checks that a positive float option stays finite and positive in `dtype`.

    A bound such as `clipnorm=1e39` is finite as a Python float but
    infinite in float32, and `1e-46` is zero there: the clipping factor
    `bound / max(norm, bound)` is then NaN. Such values are refused.

    Args:
        name: String. The argument's name, used in the error message.
        value: The validated float, or `None` (nothing to check).
        dtype: String. The floating-point dtype the value is used in.

    Raises:
        ValueError: If `value` is infinite or zero once cast to `dtype`.
    """
    if value is None:
        return
    with np.errstate(over="ignore", under="ignore"):
        cast = np.asarray(value, dtype=dtype)
    if not np.isfinite(cast) or cast <= 0:
        info = np.finfo(dtype)
        raise ValueError(
            f"`{name}` must be finite and greater than 0 in {dtype}, the "
            f"dtype it is computed in. Received: {name}={value!r}, which is "
            f"{float(cast)} in {dtype}. Pass a value between "
            f"{float(info.tiny):g} and {float(info.max):g}."
        )


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
    number = _as_finite_float(value)
    if number is None or number <= 0:
        raise ValueError(
            f"`{name}` must be a finite float greater than 0. Received: "
            f"{name}={shown(value)}. Pass a positive number such as "
            f"{name}=1.0."
        )
    return number


def non_negative_float(name: str, value: Any) -> float:
    """Returns `value` as a float after checking that it is >= 0.

    Args:
        name: String. The argument's name, used in the error message.
        value: The value received.

    Returns:
        `value` as a Python float.

    Raises:
        ValueError: If `value` is not a finite number greater than or equal
            to zero.
    """
    number = _as_finite_float(value)
    if number is None or number < 0:
        raise ValueError(
            f"`{name}` must be a finite float greater than or equal to 0. "
            f"Received: {name}={shown(value)}. Pass for example {name}=0.1, "
            f"or {name}=0.0 to turn it off."
        )
    return number


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
    return positive_int(name, value, "or None")


def positive_int(name: str, value: Any, alternative: str = "") -> int:
    """Returns `value` as an int after checking that it is in [1, MAX_INT].

    Args:
        name: String. The argument's name, used in the error message.
        value: The value received (a NumPy integer is accepted).
        alternative: String added to the message after the range, such as
            `"or None for no limit"`.

    Returns:
        `value` as a Python int.

    Raises:
        ValueError: If `value` is not an integer from 1 to `MAX_INT`.
    """
    if (
        isinstance(value, (bool, np.bool_))
        or not isinstance(value, numbers.Integral)
        or not 1 <= int(value) <= MAX_INT
    ):
        other = f", {alternative}" if alternative else ""
        raise ValueError(
            f"`{name}` must be an integer from 1 to {MAX_INT}{other}. "
            f"Received: {name}={shown(value)}. Pass for example {name}=10."
        )
    return int(value)


def seed_or_none(name: str, value: Any) -> int | None:
    """Returns a random seed after checking it: an integer >= 0, or `None`.

    Args:
        name: String. The argument's name, used in the error message.
        value: The value received.

    Returns:
        `None`, or `value` as a Python int.

    Raises:
        ValueError: If `value` is not `None` and not an integer from 0 to
            `MAX_INT`.
    """
    if value is None:
        return None
    if value == 0 and not isinstance(value, (bool, np.bool_)):
        return 0
    return positive_int(name, value, "or 0, or None")


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


def logs_selection(name: str, value: Any) -> Any:
    """Validates a selection of logs: `None`, `"all"`, or names.

    Args:
        name: String. The argument's name, used in the error message.
        value: The value received.

    Returns:
        `None`, `"all"`, or a tuple of strings (names or `fnmatch`
        patterns).

    Raises:
        ValueError: For anything else.
    """
    if value is None or value == "all":
        return value
    if (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(item, str) and item for item in value)
    ):
        return tuple(value)
    raise ValueError(
        f"`{name}` must be None (every log but the per-layer ones), 'all', "
        f"or a non-empty list of log names or patterns. Received: "
        f"{name}={value!r}. Pass for example {name}=['loss', 'accuracy', "
        "'grad_norm']."
    )


def known_names(
    name: str,
    value: Collection[str] | None,
    available: Collection[str],
    what: str,
) -> None:
    """Raises if a names option holds names that are not `available`.

    Args:
        name: String. The argument's name, used in the error message.
        value: The validated names, or `None` (nothing to check).
        available: The names that exist (layers, variables).
        what: String. What the names name, for the message ("layers").

    Raises:
        ValueError: Naming the unknown names and listing `available`.
    """
    unknown = [item for item in value or () if item not in available]
    if unknown:
        raise ValueError(
            f"`{name}` names {what} that the model does not have: "
            f"{unknown}. Received: {name}={list(value or ())}. Use names "
            f"from: {sorted(set(available))}."
        )


def one_of(allowed: tuple[Any, ...]) -> Callable[[str, Any], Any]:
    """Returns a validator accepting only the values in `allowed`.

    Args:
        allowed: Tuple of the allowed values (strings, `False`); a value is
            accepted when it equals one of them and has its type (so `0` is
            not `False`).

    Returns:
        A callable `(name, value) -> value` that raises `ValueError`, listing
        `allowed`, for any other value.
    """

    def validate(name: str, value: Any) -> Any:
        if not any(
            type(value) is type(item) and value == item for item in allowed
        ):
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


def scalar_tensor(value: Any, what: str, name: str) -> Any:
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
    if isinstance(value, (str, bytes)):
        dtype = "string"
    else:
        try:
            value = ops.convert_to_tensor(value)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"{what} {name!r} must be a number or a scalar tensor. "
                f"Received: {name}={value!r} of type {type(value).__name__}. "
                "Return a scalar tensor, for instance with `ops.mean`."
            ) from error
        dtype = keras.backend.standardize_dtype(value.dtype)
    if not dtype.startswith(("float", "int", "uint", "bfloat")):
        raise ValueError(
            f"{what} {name!r} must have a floating-point or integer dtype. "
            f"Received: {name}={value!r} of dtype {dtype}. "
            "Return a numeric scalar, for instance with `ops.mean`."
        )
    if len(value.shape) != 0:
        raise ValueError(
            f"{what} {name!r} must be a scalar. Received: {name}=<tensor of "
            f"shape {tuple(value.shape)}>. Reduce it to a scalar first, for "
            "instance with `ops.mean`."
        )
    return value


def path(name: str, value: Any, example: str) -> str:
    """Returns `value` as a string path after checking it.

    Args:
        name: String. The argument's name, used in the error message.
        value: The value received: a string or an `os.PathLike` object.
        example: String. A path shown in the message as a fix.

    Returns:
        `value` as a Python string (`os.fspath` of a path object).

    Raises:
        ValueError: If `value` is not a non-empty string or an
            `os.PathLike` object naming one (`None`, bytes, numbers).
    """
    import os

    try:
        text = os.fspath(value) if isinstance(value, os.PathLike) else value
    except TypeError:
        text = None
    if not isinstance(text, str) or not text:
        raise ValueError(
            f"`{name}` must be a non-empty string or an os.PathLike path. "
            f"Received: {name}={value!r}. Pass a path such as "
            f"{name}={example!r}."
        )
    return str(text)


def boolean_or_none(name: str, value: Any, meaning: str) -> bool | None:
    """Returns `value` after checking that it is a bool or `None`.

    Args:
        name: String. The argument's name, used in the error message.
        value: The value received.
        meaning: String. What `None` means, for the message ("the
            default").

    Returns:
        `None`, or `value` as a Python bool (a NumPy bool is accepted).

    Raises:
        ValueError: If `value` is not `True`, `False` or `None`.
    """
    if value is None:
        return None
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(
            f"`{name}` must be True, False, or None for {meaning}. "
            f"Received: {name}={value!r}. Pass {name}=True, {name}=False or "
            f"{name}=None."
        )
    return bool(value)
