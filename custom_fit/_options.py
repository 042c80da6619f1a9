"""Declared constructor options of the mixins.

A mixin declares each keyword it accepts as a class attribute:

```python
class GradientClippingMixin(TrainStepMixin):
    clipnorm = Option(None, _validation.positive_float_or_none)
```

`TrainStepMixin` finds every `Option` in the class's MRO, pops those
keywords in `__init__`, validates them, and puts them in `get_config()`;
`from_config` re-applies them. The option is then readable as a model
attribute of the same name (`model.clipnorm`) and read-only: the training
step is traced with these values, so they are fixed at construction.
"""

from collections.abc import Callable
from typing import Any


class Option:
    """A validated, read-only constructor keyword of a mixin.

    Args:
        default: The value used when the keyword is not passed.
        validate: Callable `(name, value) -> value` that raises
            `ValueError` for a bad value and returns the value to store.
    """

    def __init__(
        self, default: Any, validate: Callable[[str, Any], Any]
    ) -> None:
        self.default = default
        self.validate = validate
        self.name: str | None = None

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            return self
        return instance.__dict__.get("_custom_fit_options", {}).get(
            self.name, self.default
        )

    def __set__(self, instance: object, value: Any) -> None:
        raise AttributeError(
            f"`{self.name}` is fixed when the model is built, because the "
            f"training step is traced with it. Received an assignment: "
            f"{self.name}={value!r}. Pass it to the constructor instead, or "
            "rebuild the model from a modified `get_config()`."
        )


def declared_options(cls: type) -> dict[str, Option]:
    """Returns the `Option`s that `cls` and its bases declare.

    Args:
        cls: A class.

    Returns:
        A dict mapping each option name to its `Option`, base classes
        first, in declaration order.
    """
    options = {}
    for klass in reversed(cls.__mro__):
        for name, attribute in vars(klass).items():
            if isinstance(attribute, Option):
                options[name] = attribute
    return options


def store_options(instance: object, values: dict[str, Any]) -> None:
    """Validates `values` and stores them on `instance`.

    Args:
        instance: The model.
        values: Dict of option name to received value. Options missing
            from it keep their current value (the default at first).

    Raises:
        ValueError: From the option's validator, naming the argument.
    """
    stored = instance.__dict__.setdefault("_custom_fit_options", {})
    for name, option in declared_options(type(instance)).items():
        if name in values:
            stored[name] = option.validate(name, values[name])
