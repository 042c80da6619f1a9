"""A model's options over its life: taken, checked and stored, then read.

`Configured` is a base of `TrainStepMixin` (not for direct use): its
`__init__` takes the options the class declares out of the keywords
(`custom_fit._options`), refuses unknown ones, builds the Keras model, and
stores the options with the state they need (`_configure_options`, which
each mixin extends to check its own); `option_in_step` reads an option as
the running step uses it (a schedule evaluated at the update count).
"""

from typing import Any

import keras
from keras import ops

from custom_fit import _guard
from custom_fit import _keras_compat
from custom_fit import _model_state
from custom_fit import _options
from custom_fit import _step_checks
from custom_fit import _validation
from custom_fit import backend
from custom_fit._types import ModelBase


class Configured(ModelBase):
    """Options taken at construction, checked, stored and read in the step.

    A base of `TrainStepMixin` (not for direct use): its methods are the
    model's.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._check_model()
        options = _options.pop_options(type(self), kwargs)
        _options.refuse_unknown_keywords(type(self), args, kwargs)
        source = _keras_compat.model_being_cloned()
        super().__init__(*args, **kwargs)
        if not options:
            # From `from_config`: the options Keras does not pass on.
            options = _options.take_pending(type(self)) or {}
        if not options and isinstance(source, Configured):
            # keras.models.clone_model builds the clone without keywords;
            # the secret options (a seed) are not copied, as not saved.
            saved = _options.saved_options(type(source))
            options = {
                name: value
                for name, value in _model_state.state_of(source).options.items()
                if name in saved
            }
        self._configure_options(options)

    def _check_model(self) -> None:
        """Raises for a backend, step override or strategy it refuses."""
        backend.check_supported()
        _step_checks.refuse_stateless_step_overrides(type(self), Configured)
        backend.current().check_strategy()

    def _configure_if_needed(self) -> None:
        """Configures the default options of a model built without them.

        A class that mixes the trainer into a `keras.layers.Layer` may call
        the `__init__` of its Keras bases directly (as Keras' own trainer
        tests do), so that `Configured.__init__` never ran.
        """
        if _model_state.state_of(self).guard is None:
            self._check_model()
            self._configure_options({})

    def _configure_options(self, options: dict[str, Any]) -> None:
        """Validates and stores `options`, then creates the state they need."""
        dtype = keras.backend.standardize_dtype(
            self.dtype_policy.variable_dtype
        )
        _options.store_options(self, options, dtype)
        _options.make_states(self)
        state = _model_state.state_of(self)
        state.guard = _guard.Guard(self)

    def option_in_step(self, name: str) -> Any:
        """Returns option `name` as the running step uses it.

        Call it inside the step (a hook such as `transform_gradients`) to
        read an option declared with `schedulable=True`: a schedule is
        evaluated at the update count of the optimizer of the running update,
        before the update (0 at the first step), as Keras evaluates a
        learning-rate schedule, and the value in force is reported under the
        option's `logged_as` name (`"last"` reduction); any other value is
        returned as is.

        Args:
            name: String. The name of an option of the model.

        Returns:
            The option's value, or a float32 scalar tensor for a schedule.

        Example:

        ```python
        def transform_gradients(self, gradients, variables):
            stddev = self.option_in_step("gradient_noise_stddev")
            ...
        ```
        """
        options = _options.declared_options(type(self))
        if name not in options:
            raise ValueError(
                f"`option_in_step` reads a declared option of the model. "
                f"Received: name={name!r}. The options of "
                f"{type(self).__name__} are {list(options)}."
            )
        value = getattr(self, name)
        if not _validation.is_schedule(value):
            return value
        optimizer = getattr(
            _model_state.state_of(self).local, "optimizer", None
        )
        optimizer = optimizer or self.optimizer
        current = ops.cast(
            value(ops.convert_to_tensor(optimizer.iterations)), "float32"
        )
        self._report(options[name].logged_as, current, reduction="last")
        return current
