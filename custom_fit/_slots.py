"""Declared state made the first time the step asks for it.

Two declarations: `options.Slots`, one variable per trained variable, and
`options.Buffers`, variables whose shape only the step knows (a count of
losses, of layers). A transform that keeps something per weight (an
average of each gradient, as an optimizer's momentum) declares `Slots`
once as a class attribute; each model then holds one `VariableSlots`,
which makes a slot, shaped and laid out as its variable, the first time
the step asks for that variable, and lists it in the model's state so that
a pure step (JAX) carries it. Slots declared `saved=True` go into the
model's weights file beside the weights (`save_own_variables`) under keys
of their own, and come back on loading. A `Buffers` declaration makes each
model one `ShapedBuffers`, which makes a variable per key, of the shape
given the first time that key is asked for, listed in the same way.
"""

from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np

from custom_fit import _model_state
from custom_fit import _options
from custom_fit import _state
from custom_fit import _validation
from custom_fit import backend
from custom_fit._types import Variable

# Keys of saved slots in a model's entry of the weights file:
# `<prefix><declared name>:<index of the variable in model.variables>`.
# Keras' own keys there are the indices of the model's own variables
# ("0", "1", ...).
_PREFIX = "custom_fit.slot:"


class Slots(_options.State):
    """One state variable per trained variable, made for each model.

    Declare it as a class attribute of a mixin. Inside the step,
    `self.<name>.of(variables, key=None)` returns one slot per variable
    given (another `key` gives other slots, `items(key)` lists them): zero
    at first, of the variable's shape and dtype (or `dtype`), laid out as
    it is (sharded with it under `keras.distribution.ModelParallel`), made
    the first time the step asks for that variable and the same one at
    every step after. Read a slot with `keras.ops`, write it with
    `.assign`. The slots travel with the step as a `State` does (JAX's
    step is pure; one copy per replica under `tf.distribute`, each
    writing the same, global figures).

    Args:
        dtype: Optional string. The slots' dtype. Defaults to `None`: each
            variable's own.
        saved: Bool. If `True`, the slots of the model's variables are
            saved with its weights (`model.save`, `save_weights`,
            `keras.callbacks.BackupAndRestore`) and loaded with them, as
            an optimizer's slots are; loading a file whose slots this
            model does not declare is refused. If `False`, they are no
            part of the model's files and a loaded model starts them from
            zero, as a `State`. Defaults to `False`.
        requires: As `State`'s.

    Example:

    ```python
    class GradientAverageMixin(custom_fit.TrainStepMixin):
        gradient_averages = options.Slots(saved=True)

        def transform_gradients(self, gradients, variables):
            averages = self.gradient_averages.of(variables)
            for gradient, average in zip(gradients, averages):
                average.assign(0.9 * average + 0.1 * gradient)
            return super().transform_gradients(gradients, variables)
    ```
    """

    def __init__(
        self,
        dtype: str | None = None,
        *,
        saved: bool = False,
        requires: Sequence[str] = (),
    ) -> None:
        if dtype is not None:
            try:
                dtype = keras.backend.standardize_dtype(dtype)
            except ValueError:
                raise ValueError(
                    "`dtype` is the slots' dtype, or None for each "
                    f"variable's own. Received: dtype={dtype!r}."
                ) from None
        super().__init__((), dtype or "float32", requires=requires)
        self.slot_dtype = dtype
        self.saved = _validation.boolean("saved", saved)

    def _describe(self, owner: str) -> str:
        return (
            f"The slots `{self.name}` of {owner}: one per trained variable"
            + (", saved with the weights." if self.saved else ".")
        )

    def __repr__(self) -> str:
        return f"Slots(dtype={self.slot_dtype!r}, saved={self.saved})"

    def make(self, instance: object) -> "VariableSlots":
        """Returns the (empty) slots of `instance`."""
        return VariableSlots(instance, self.name, self.slot_dtype, self.saved)


class _MadeInStep:
    """What one declaration made so far in one model, made on first use.

    Read as `self.<name>` inside the step; not made directly.
    """

    def __init__(self, model: Any, name: str, dtype: str | None) -> None:
        self._model = model
        self._name = name
        self._dtype = dtype
        self._made: dict[Any, Any] = {}

    def _new(self, make: Callable[..., Any], *args: Any) -> Any:
        """Returns `make(*args)`, made in the model's scope and listed.

        The scope makes it one per replica in or outside the step; the
        model's state lists it, so that a pure step carries it.
        """
        with backend.current().model_scope(self._model):
            variable = make(*args)
        _model_state.state_of(self._model).holder.track(variable)
        return variable


def _check_key(name: str, key: Any) -> None:
    """Raises if `key` cannot key what a declaration makes."""
    try:
        hash(key)
    except TypeError:
        raise ValueError(
            f"A key of `{name}` is hashable (a string, a number, a tuple). "
            f"Received: key={key!r}."
        ) from None


class VariableSlots(_MadeInStep):
    """The slots of one `Slots` declaration in one model.

    Read as `self.<name>` inside the step; not made directly. Its made
    slots are kept by key and the variable's id, with the variable (held,
    so that its id is not reused).
    """

    def __init__(
        self, model: Any, name: str, dtype: str | None, saved: bool
    ) -> None:
        super().__init__(model, name, dtype)
        self._saved = saved

    def of(self, variables: Sequence[Variable], key: Any = None) -> list[Any]:
        """Returns the slot of each variable, made on first use.

        Args:
            variables: List of the variables (as the hooks receive them).
            key: Optional hashable: slots under another key are others
                (one set per call site that needs its own). Defaults to
                `None`. Saved slots take no key.

        Returns:
            A list of state variables aligned with `variables`.

        Raises:
            ValueError: if `variables` is not a list of variables, or a
                key is given for slots declared `saved=True`.
        """
        if isinstance(variables, (str, bytes)) or not isinstance(
            variables, Sequence
        ):
            raise ValueError(
                f"`{self._name}.of(variables)` takes a list of variables, "
                f"as the hooks receive them. Received: variables={variables!r}."
            )
        _check_key(self._name, key)
        if key is not None and self._saved:
            raise ValueError(
                f"The slots `{self._name}` are saved with the weights, one "
                f"per variable: they take no key. Received: key={key!r}."
            )
        slots = []
        for variable in variables:
            made = (key, id(variable))
            if made not in self._made:
                if not all(hasattr(variable, a) for a in ("shape", "dtype")):
                    raise ValueError(
                        f"`{self._name}.of(variables)` takes variables. "
                        f"Received an element {variable!r} in variables."
                    )
                dtype = self._dtype or keras.backend.standardize_dtype(
                    variable.dtype
                )
                slot = self._new(_state.state_like, variable, dtype, self._name)
                self._made[made] = (variable, slot)
            slots.append(self._made[made][1])
        return slots

    def items(self, key: Any = None) -> Iterator[tuple[Variable, Any]]:
        """Yields `(variable, slot)` for each slot made so far under `key`."""
        for (under, _), pair in self._made.items():
            if under == key:
                yield pair


class Buffers(_options.State):
    """State variables whose shape the step gives, made for each model.

    Declare it as a class attribute of a mixin when the shape is known only
    in the step (one entry per loss, per layer). Inside the step,
    `self.<name>.variable(shape)` returns a variable of that shape, zero at
    first, made the first time the step asks for it and the same one at
    every step after; `key=` keeps several under one declaration (one per
    set of variables, say). Read it with `keras.ops`, write it with
    `.assign`. It travels with the step as a `State` does (JAX's step is
    pure; one copy per replica under `tf.distribute`, each writing the
    same, global figures), and as a `State` it is no part of the model's
    files. Outside the step, `self.<name>.get(key)` returns a made variable
    (or `None`) for a callback or a property to read.

    Args:
        dtype: String. The variables' dtype. Defaults to `"float32"`.
        requires: As `State`'s.

    Example:

    ```python
    class LossTotalsMixin(custom_fit.TrainStepMixin):
        loss_totals = options.Buffers("float32")

        def combine_gradients(self, gradients_by_loss, variables):
            totals = self.loss_totals.variable((len(gradients_by_loss),))
            totals.assign(totals + 1.0)
            return super().combine_gradients(gradients_by_loss, variables)
    ```
    """

    def __init__(
        self, dtype: str = "float32", *, requires: Sequence[str] = ()
    ) -> None:
        try:
            if dtype is None:
                raise ValueError(dtype)
            dtype = keras.backend.standardize_dtype(dtype)
        except (TypeError, ValueError):
            raise ValueError(
                f"`dtype` is the buffers' dtype. Received: dtype={dtype!r}."
            ) from None
        super().__init__((), dtype, requires=requires)

    def _describe(self, owner: str) -> str:
        return (
            f"The buffers `{self.name}` of {owner}: {self.dtype}, of the "
            "shape the step gives."
        )

    def make(self, instance: object) -> "ShapedBuffers":
        """Returns the (empty) buffers of `instance`."""
        return ShapedBuffers(instance, self.name, self.dtype)

    def __repr__(self) -> str:
        return f"Buffers({self.dtype!r})"


class ShapedBuffers(_MadeInStep):
    """The variables of one `Buffers` declaration in one model.

    Read as `self.<name>` inside the step; not made directly.
    """

    def variable(self, shape: Sequence[int], key: Any = None) -> Any:
        """Returns the variable under `key`, made of `shape` on first use.

        Args:
            shape: Tuple of ints, the variable's shape.
            key: Optional hashable, to keep several variables under one
                declaration. Defaults to `None`.

        Returns:
            The state variable.

        Raises:
            ValueError: if `shape` is not a tuple of non-negative ints, or
                the variable under `key` was made with another shape.
        """
        sizes = (
            tuple(int(size) for size in shape)
            if isinstance(shape, (tuple, list))
            and all(
                isinstance(size, (int, np.integer))
                and not isinstance(size, bool)
                and size >= 0
                for size in shape
            )
            else None
        )
        if sizes is None:
            raise ValueError(
                f"`{self._name}.variable(shape)` takes a tuple of "
                f"non-negative ints. Received: shape={shape!r}."
            )
        _check_key(self._name, key)
        made = self._made.get(key)
        if made is None:
            made = self._new(
                backend.current().state_variable,
                sizes,
                self._dtype or "float32",
                self._name,
                False,
            )
            self._made[key] = made
        elif tuple(made.shape) != sizes:
            raise ValueError(
                f"The buffer `{self._name}` under key {key!r} was made of "
                f"shape {tuple(made.shape)}. Received: shape={sizes}. "
                "Give each shape a key of its own."
            )
        return made

    def get(self, key: Any = None) -> Any:
        """Returns the variable made under `key`, or `None`."""
        return self._made.get(key)

    def items(self) -> Iterator[tuple[Any, Any]]:
        """Yields `(key, variable)` for each variable made so far."""
        yield from self._made.items()


def _saved_slots(model: Any) -> dict[str, VariableSlots]:
    """The made slots of `model`'s declarations with `saved=True`."""
    made = _model_state.state_of(model).declared
    return {
        name: made[name]
        for name, declared in _options.declared_states(type(model)).items()
        if isinstance(declared, Slots) and declared.saved and name in made
    }


def save(model: Any, store: Any) -> None:
    """Writes the saved slots of `model`'s variables into `store`.

    Each under its declaration's name and its variable's index in
    `model.variables` (the order Keras loads weights in: a model built
    again, whose layers have other names, finds them). Slots of variables
    that are not the model's are not written.
    """
    index = {id(variable): i for i, variable in enumerate(model.variables)}
    for name, slots in _saved_slots(model).items():
        for variable, slot in slots.items():
            if id(variable) in index:
                store[f"{_PREFIX}{name}:{index[id(variable)]}"] = (
                    backend.current().host_value(model, slot)
                )


def load(model: Any, store: Any) -> Any:
    """Assigns the saved slots in `store`; returns the rest of `store`.

    The slots are made for the model's variables the file names, so that
    a model loaded before its first step goes on from them.

    Raises:
        ValueError: if `store` holds slots that `model` does not declare
            with `saved=True` (or does not make at its options), or slots
            that do not fit the model's variables.
    """
    keys = list(store.keys()) if store is not None else []
    ours = [key for key in keys if key.startswith(_PREFIX)]
    if not ours:
        return store
    slots = _saved_slots(model)
    variables = model.variables
    for key in ours:
        name, _, index = key[len(_PREFIX) :].partition(":")
        value = np.asarray(store[key])
        at = int(index) if index.isdigit() else len(variables)
        variable = variables[at] if at < len(variables) else None
        if name not in slots:
            problem = f"declares no saved slots `{name}` at its options"
        elif variable is None or tuple(variable.shape) != value.shape:
            problem = (
                f"has no variable of shape {value.shape} at index {index} "
                "of its variables"
            )
        else:
            (slot,) = slots[name].of([variable])
            slot.assign(value)
            continue
        raise ValueError(
            f"The weights file holds the slots `{name}` of the variable at "
            f"index {index}, but {type(model).__name__} {problem}. "
            f"Received: the key {key!r}. Load it into the model class (and "
            "options) that saved it."
        )
    return _Without(store, ours)


class _Without:
    """A weights-file entry without some of its keys (read only)."""

    def __init__(self, store: Any, left_out: Sequence[str]) -> None:
        self._store = store
        self._keys = [key for key in store.keys() if key not in left_out]

    def keys(self) -> list[str]:
        return list(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys:
            raise KeyError(key)
        return self._store[key]
