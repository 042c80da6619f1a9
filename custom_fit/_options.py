"""Declared constructor options of the mixins.

A mixin declares each keyword it accepts as a class attribute:

```python
class GradientClippingMixin(TrainStepMixin):
    clipnorm = Option(None, _validation.positive_float_or_none, bound=True)
    clip_layers = Option(None, _validation.names_or_none,
                         requires=CLIPPING_OPTIONS)
```

`TrainStepMixin` finds every `Option` in the class's MRO, pops those
keywords in `__init__`, validates them, checks that each option set away
from its default has the options it needs, and puts them in
`get_config()`; `from_config` hands them to the constructor Keras calls
(`pending`), so that a model is never built without its options. The
option is then readable as a model attribute of the same name
(`model.clipnorm`) and read-only: the training step is traced with these
values, so they are fixed at construction. Keywords that are no option and
that Keras would drop (a functional model ignores unknown keywords) are
refused, with the closest option name as a suggestion.
"""

import contextlib
import difflib
import functools
import inspect
import threading
import types
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import keras

from custom_fit import _model_state
from custom_fit import _validation
from custom_fit import backend

# Keywords a functional model's constructor uses; Keras' `Functional`
# silently drops every other one.
_FUNCTIONAL_KEYWORDS = ("inputs", "outputs", "name", "trainable")


class Option:
    """A constructor option of a mixin: validated, saved, read-only.

    Declare it as a class attribute of a mixin deriving from
    `custom_fit.TrainStepMixin`, as custom_fit's own mixins declare theirs.
    The model's constructor then takes a keyword of the attribute's name: it
    is validated when the model is built, checked against the options it
    `requires` and `excludes`, listed in `inspect.signature` and `help()`,
    saved in `get_config()` and restored by `from_config` and `.keras`
    loading. Read it as `model.<name>`; assigning it raises on every
    backend, because the compiled step is traced with it. A misspelled
    keyword is refused with "Did you mean", and an option of a mixin the
    model lacks names the mixin to add.

    Args:
        default: The value used when the keyword is not passed.
        validate: Callable `(name, value) -> value` that raises `ValueError`
            for a bad value and returns the value to store (see the
            validators of `custom_fit.options`), or `None` to accept any
            value.
        requires: Tuple of option names. A value other than `default` has
            an effect only when one of them is set (away from its default,
            and not `None` or `False`); otherwise it is refused.
        excludes: Tuple of option names that cannot be set together with
            this one (both away from their defaults).
        required: Bool. The model cannot be built without it: its default
            must be `None`, and a model whose value is `None` is refused,
            naming the option.
        schedulable: Bool. The option also accepts a
            `keras.optimizers.schedules.LearningRateSchedule`, evaluated in
            the step at the optimizer's update count: read it in the step
            with `model.option_in_step(name)`, which also reports the value
            in force under `logged_as`.
        logged_as: String. The log key of a scheduled option's value in
            force; defaults to the option's name.
        bound: Bool. The value is a float used in the model's variable
            dtype: it must stay finite and positive there.
        kind: String naming what the option does, shared by options of one
            capability (`"clipping"`): `any_set(model, kind)` tells whether
            the model uses that capability.
        or_capability: String. A class attribute that, when true on the
            model's class, satisfies `requires` too (a mixin that always
            uses the option, such as inspection for `layer_depth`).
        saved: Bool. Whether `get_config()` (and so `.keras` files and
            clones) keeps the value. `False` for a secret, such as a noise
            seed: a rebuilt model then takes the default.
        former_defaults: Tuple of values that were the default in an
            earlier version, which `get_config()` then saved with every
            model. Loading such a value where it has no effect (none of
            `requires` set) takes the present default instead of refusing
            the file; where it has an effect it is kept, so the model
            trains as when it was saved.

    Example:

    ```python
    class GradientNoiseMixin(custom_fit.TrainStepMixin):
        gradient_noise_stddev = custom_fit.options.Option(
            0.0, custom_fit.options.non_negative_float, schedulable=True)
    ```
    """

    def __init__(
        self,
        default: Any,
        validate: Callable[[str, Any], Any] | None = None,
        *,
        requires: Sequence[str] = (),
        excludes: Sequence[str] = (),
        schedulable: bool = False,
        logged_as: str = "",
        bound: bool = False,
        kind: str = "",
        or_capability: str = "",
        saved: bool = True,
        former_defaults: Sequence[Any] = (),
        required: bool = False,
    ) -> None:
        if required and default is not None:
            raise TypeError(
                "A required option has no default value: its default must "
                f"be None. Received: default={default!r}, required=True."
            )
        self.required = required
        self.default = default
        self.saved = saved
        self.former_defaults = tuple(former_defaults)
        self.validate = validate or _any_value
        self.requires = _names("requires", requires)
        self.excludes = _names("excludes", excludes)
        self.bound = bound
        self.kind = kind
        self.schedulable = schedulable
        self.logged_as = logged_as
        self.or_capability = or_capability
        self.name: str | None = None
        self.owner: type | None = None

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.logged_as = self.logged_as or name
        self.owner = owner
        _OWNERS.setdefault(name, []).append(owner)
        # What `help()` and the API reference show for the attribute.
        self.__doc__ = (
            f"The constructor option `{name}` of {owner.__name__} (see the "
            "class's Args): read-only."
        )

    def __repr__(self) -> str:
        schedulable = ", schedulable=True" if self.schedulable else ""
        return f"Option(default={self.default!r}{schedulable})"

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            return self
        state = instance.__dict__.get("_custom_fit")
        if state is None:
            return self.default
        return state.options.get(self.name, self.default)

    def __set__(self, instance: object, value: Any) -> None:
        raise AttributeError(
            f"`{self.name}` is fixed when the model is built: the compiled "
            "step of TensorFlow and JAX is traced with it and would ignore "
            "a new value, so it is refused on every backend alike. Received "
            f"an assignment: {self.name}={value!r}. Pass it to the "
            "constructor instead, or build a new model from a modified "
            "`get_config()`."
        )


# Option name -> the classes that declare one of that name, custom_fit's
# mixins and users' own alike: a keyword a model refuses may be an option of
# a mixin it lacks.
_OWNERS: dict[str, list[type]] = {}


def is_option_name(name: str) -> bool:
    """Returns whether some class declares an option named `name`."""
    return name in _OWNERS


def _any_value(name: str, value: Any) -> Any:
    """Accepts any value: the validator of an `Option` declared without."""
    del name
    return value


def _names(argument: str, names: Any) -> tuple[str, ...]:
    """Returns option names given to `Option`, checked."""
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise ValueError(
            f"`{argument}` must be a tuple of option names. Received: "
            f"{argument}={names!r}. Pass for example {argument}=('clipnorm',)."
        )
    return tuple(names)


class State:
    """A state variable of a mixin, made for each model and carried by its step.

    Declare it as a class attribute of a mixin, beside its options. Each
    model gets its own variable, zero when the model is built; read and
    write it inside the step as `self.<name>` (`keras.ops` reads it,
    `.assign` writes it). It is custom_fit's state, made for every backend
    alike: carried with the step on JAX (whose step is pure), one copy per
    replica under `tf.distribute` (each replica writes the same, global
    figures), laid out beside the model's weights. It is not one of the
    model's weights: `get_weights()` and `.keras` files leave it out, and a
    loaded model starts it from zero again.

    Args:
        shape: Tuple of ints. The variable's shape. Defaults to `()`.
        dtype: String. Its dtype. Defaults to `"float32"`.
        requires: Tuple of option names: the variable is made only when
            one of them is set (away from `None`, `False` and the default
            the class that first declares it gives it). Defaults to `()`
            (always).

    Example:

    ```python
    class NormAverageMixin(custom_fit.TrainStepMixin):
        gradient_norm_total = custom_fit.options.State((), "float32")

        def inspect_gradients(self, gradients, transformed, variables,
                              optimizer=None):
            super().inspect_gradients(
                gradients, transformed, variables, optimizer=optimizer)
            norm = custom_fit.clipping.global_norm(gradients)
            self.gradient_norm_total.assign(self.gradient_norm_total + norm)
    ```
    """

    def __init__(
        self,
        shape: Sequence[int] = (),
        dtype: str = "float32",
        *,
        requires: Sequence[str] = (),
    ) -> None:
        self.shape = tuple(int(size) for size in shape)
        self.dtype = dtype
        self.requires = _names("requires", requires)
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.__doc__ = self._describe(owner.__name__)

    def _describe(self, owner: str) -> str:
        """The declaration's docstring (`help()` of the class shows it)."""
        return (
            f"The state variable `{self.name}` of {owner}: shape "
            f"{self.shape}, {self.dtype}."
        )

    def __repr__(self) -> str:
        return f"State(shape={self.shape}, dtype={self.dtype!r})"

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            return self
        made = _model_state.state_of(instance).declared.get(self.name)
        if made is None:
            raise ValueError(
                f"The state `{self.name}` of {type(instance).__name__} was "
                f"not made: it requires one of {list(self.requires)} to be "
                f"set. Received: a read of `{self.name}`. Set one of them, "
                "or read it only when they are."
            )
        return made

    def make(self, instance: object) -> Any:
        """Returns the variable of `instance`, listed in its state."""
        variable = backend.current().state_variable(
            self.shape, self.dtype, self.name, False
        )
        _model_state.state_of(instance).holder.track(variable)
        return variable

    def __set__(self, instance: object, value: Any) -> None:
        raise AttributeError(
            f"`{self.name}` is a state variable: write it with "
            f"`self.{self.name}.assign(value)` inside the step. Received an "
            f"assignment: {self.name}={value!r}."
        )


class Seeds(State):
    """A seed generator of a mixin, made for each model, carried by its step.

    Declare it as a class attribute beside the option that holds its seed;
    read it inside the step as `self.<name>` and pass it as the `seed` of
    `keras.random` functions. Each model gets its own generator when it is
    built, whose state travels with the step as a `State`'s does (JAX's
    step is pure; one state per replica under `tf.distribute`, each
    drawing the same numbers). Like a `State`, it is not saved with the
    model: a loaded model starts from its seed again.

    Args:
        seed_option: String. The name of the option holding the seed (an
            int, or `None` for a seed of the generator's own).
        secret: Bool. If `True`, a generator no one may predict when no
            seed is given: seeded from the operating system's entropy
            (with every secret bit the backend's draws read), and over
            several processes given process 0's secret by `fit` (DP-SGD's
            noise). If `False`, `keras.random.SeedGenerator`'s own seed.
            Defaults to `False`.
        requires: As `State`'s.

    Example:

    ```python
    class GradientDropoutMixin(custom_fit.TrainStepMixin):
        dropout_seed = options.Option(None, options.seed_or_none)
        dropout_seeds = options.Seeds("dropout_seed")

        def transform_gradients(self, gradients, variables):
            gradients = [
                keras.random.dropout(g, 0.1, seed=self.dropout_seeds)
                for g in gradients]
            return super().transform_gradients(gradients, variables)
    ```
    """

    def __init__(
        self,
        seed_option: str,
        *,
        secret: bool = False,
        requires: Sequence[str] = (),
    ) -> None:
        super().__init__((2,), "uint32", requires=requires)
        if not isinstance(seed_option, str) or not seed_option:
            raise ValueError(
                "`seed_option` names the option that holds the seed. "
                f"Received: seed_option={seed_option!r}. Pass the option's "
                "name, for example Seeds('dropout_seed')."
            )
        self.seed_option = seed_option
        self.secret = _validation.boolean("secret", secret)

    def _describe(self, owner: str) -> str:
        return (
            f"The seed generator `{self.name}` of {owner}, seeded by "
            f"the option `{self.seed_option}`"
            + (" (secret when not given)." if self.secret else ".")
        )

    def __repr__(self) -> str:
        return f"Seeds({self.seed_option!r}, secret={self.secret})"

    def make(self, instance: object) -> Any:
        """Returns the seeded generator of `instance`, in its state."""
        generator = self._generator(instance)
        _model_state.state_of(instance).holder.track(generator.state)
        return generator

    def _generator(self, instance: object) -> Any:
        seed = getattr(instance, self.seed_option)
        _model_state.state_of(instance).seeded[self.name] = seed
        if self.secret:
            return backend.current().secret_seeds(seed)
        return keras.random.SeedGenerator(seed)

    def reseed(self, instance: object, generator: Any) -> None:
        """Seeds `generator` again if its option changed since it was made.

        Options applied after the model was built (`from_config` for a
        model Keras builds another way) configure it a second time.
        """
        seed = getattr(instance, self.seed_option)
        if _same(seed, _model_state.state_of(instance).seeded.get(self.name)):
            return
        generator.state.assign(self._generator(instance).state.value)


def declared_states(cls: type) -> dict[str, State]:
    """Returns the `State`s that `cls` and its bases declare, bases first."""
    states: dict[str, State] = {}
    for klass in reversed(cls.__mro__):
        for name, attribute in vars(klass).items():
            if isinstance(attribute, State):
                states[name] = attribute
    return states


def make_states(instance: object) -> None:
    """Makes the declared state variables of a model, once each.

    Those whose `requires` options are all at their defaults (as the
    class that first declares each gives it) are not made.
    """
    state = _model_state.state_of(instance)
    defaults = _first_defaults(type(instance))
    for name, declared in declared_states(type(instance)).items():
        if isinstance(declared, Seeds) and name in state.declared:
            declared.reseed(instance, state.declared[name])
            continue
        if name in state.declared:
            continue
        if declared.requires and not any(
            other in defaults
            and _counts_as_set(getattr(instance, other), defaults[other])
            for other in declared.requires
        ):
            continue
        state.declared[name] = declared.make(instance)


def _first_defaults(cls: type) -> dict[str, Any]:
    """Each option's default as the class that first declares it gives it.

    A subclass that narrows an option's default (`skip_nonfinite=True`
    by default) has set it, as far as the state it requires goes.
    """
    defaults: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        for name, attribute in vars(klass).items():
            if isinstance(attribute, Option) and name not in defaults:
                defaults[name] = attribute.default
    return defaults


def _counts_as_set(value: Any, default: Any) -> bool:
    """Whether an option's `value` counts as set for what `requires` it.

    Away from `None`, `False` and `default` (the one its first declarer
    gives, `_first_defaults`); `excludes` compares with the default alone.
    """
    return _is_set(value) and not _same(value, default)


def agree_on_secret_seeds(instance: object) -> None:
    """Gives each secret `Seeds` generator of a model process 0's state.

    Over several processes (JAX's, PyTorch's), a collective every process
    calls before training: a secret seed is drawn in each process (JAX's
    is a public placeholder until then), and the step must draw the same
    numbers in all. Nothing in one process.
    """
    made = _model_state.state_of(instance).declared
    for name, declared in declared_states(type(instance)).items():
        if isinstance(declared, Seeds) and declared.secret and name in made:
            given = getattr(instance, declared.seed_option) is not None
            backend.current().agree_on_seeds(made[name], given=given)


def declared_options(cls: type) -> dict[str, Option]:
    """Returns the `Option`s that `cls` and its bases declare.

    Args:
        cls: A class.

    Returns:
        A dict mapping each option name to its `Option`, base classes
        first, in declaration order.
    """
    return dict(_declared(cls))


@functools.cache
def _declared(cls: type) -> tuple[tuple[str, Option], ...]:
    """Returns the `Option`s of `cls`, found once per class.

    An eager step asks for them at every step.
    """
    options = {}
    for klass in reversed(cls.__mro__):
        for name, attribute in vars(klass).items():
            if isinstance(attribute, Option):
                options[name] = attribute
    return tuple(options.items())


def any_set(instance: object, kind: str) -> bool:
    """Returns whether an option of `kind` is set (not `None` nor `False`).

    Args:
        instance: A model.
        kind: The `kind` of the options, e.g. `"clipping"`.

    Returns:
        Bool.
    """
    return any(
        option.kind == kind and _is_set(getattr(instance, name))
        for name, option in declared_options(type(instance)).items()
    )


def declared_reports(cls: type) -> tuple[str, ...]:
    """Returns the metric names the mixins of `cls` report.

    Each mixin lists them in a class attribute `reports`; a user's term or
    metric of such a name would be merged with the mixin's.

    Args:
        cls: A class.

    Returns:
        A tuple of names, base classes first.
    """
    names: dict[str, None] = {}
    for klass in reversed(cls.__mro__):
        names.update(dict.fromkeys(vars(klass).get("reports", ())))
    return tuple(names)


def declaring_classes(cls: type, name: str) -> tuple[type, ...]:
    """Returns the classes of `cls`'s MRO whose own `reports` claim `name`.

    A declared name claims itself and its `<name>/...` keys (per-layer
    figures). Empty when no class declares it.
    """
    return tuple(
        klass
        for klass in cls.__mro__
        if any(
            name == declared or name.startswith(f"{declared}/")
            for declared in vars(klass).get("reports", ())
        )
    )


def reporting_class(model: Any, frame: types.FrameType | None) -> type | None:
    """Returns the class of `model` whose method is reporting.

    The nearest frame from `frame` outwards that runs a function defined
    in a class of `model`'s MRO (the class its `__qualname__` names, so an
    alias in a subclass still counts as its own class'), for `model`
    itself (its `self`); functions nested in a method (a loss function)
    count as the method. `None` when no such frame is found (a free
    function reporting for the model).
    """
    methods = _methods_of(type(model))
    while frame is not None:
        owner = methods.get(frame.f_code)
        if owner is not None and frame.f_locals.get("self") is model:
            return owner
        frame = frame.f_back
    return None


# Per model class; emptied past a bound (classes made in loops, tests).
_METHODS: dict[type, dict[types.CodeType, type]] = {}


def _methods_of(cls: type) -> dict[types.CodeType, type]:
    """Maps the code of every function defined in `cls`'s MRO to its class."""
    found = _METHODS.get(cls)
    if found is None:
        if len(_METHODS) >= 256:
            _METHODS.clear()
        found = _METHODS[cls] = _functions_of(cls)
    return found


def _functions_of(cls: type) -> dict[types.CodeType, type]:
    """`_methods_of`, computed."""
    by_name = {klass.__qualname__: klass for klass in cls.__mro__}
    found: dict[types.CodeType, type] = {}
    for klass in cls.__mro__:
        for value in vars(klass).values():
            for function in (
                value,
                getattr(value, "__func__", None),  # static, class methods
                getattr(value, "fget", None),  # properties
            ):
                if not callable(function):
                    continue
                function = inspect.unwrap(function)
                code = getattr(function, "__code__", None)
                if code is None:
                    continue
                qualname = getattr(function, "__qualname__", "")
                defined_in = by_name.get(qualname.rpartition(".")[0], klass)
                found.setdefault(code, defined_in)
    return found


def pop_options(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Removes the declared options of `cls` from `kwargs`; returns them."""
    return {
        name: kwargs.pop(name)
        for name in declared_options(cls)
        if name in kwargs
    }


_PENDING = threading.local()


class _Pending:
    """Options held for the next constructor of `cls` in this thread."""

    def __init__(self, cls: type, options: dict[str, Any]) -> None:
        self.cls = cls
        self.options = dict(options)
        self.taken = False


@contextlib.contextmanager
def pending(cls: type, options: dict[str, Any]) -> Iterator[_Pending]:
    """Holds `options` for the next constructor of `cls` in this thread.

    Keras' `from_config` builds the model with the keywords it knows (a
    `Sequential` drops the others); the constructor of `cls` that it calls
    takes `options` with `take_pending`, once. The context's value says
    whether it did (`.taken`).
    """
    previous = getattr(_PENDING, "value", None)
    held = _Pending(cls, options)
    _PENDING.value = held
    try:
        yield held
    finally:
        _PENDING.value = previous


def take_pending(cls: type) -> dict[str, Any] | None:
    """Returns the options `pending` holds for `cls`, once; else `None`."""
    held = getattr(_PENDING, "value", None)
    if held is None or held.cls is not cls or held.taken:
        return None
    held.taken = True
    return held.options


def refuse_unknown_keywords(
    cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    """Raises for keywords that would be dropped or that look misspelled.

    A functional model (built from `inputs` and `outputs`) uses only
    `_FUNCTIONAL_KEYWORDS`; Keras drops any other keyword without a word,
    so every other one is refused here. Other models pass the keywords on
    to Keras, which refuses unknown ones itself; a keyword close to an
    option's name is refused here first, with the suggestion.

    Args:
        cls: The model class.
        args: The positional arguments of the constructor.
        kwargs: Its keyword arguments, options already removed.

    Raises:
        ValueError: Naming the keyword and the closest option.
    """
    options = list(declared_options(cls))
    functional = _is_functional_call(args, kwargs)
    for key in kwargs:
        if functional and key in _FUNCTIONAL_KEYWORDS:
            continue
        received = f"Received: {key}={kwargs[key]!r}."
        if key in _OWNERS:
            raise ValueError(_missing_mixin(cls, key, received))
        close = difflib.get_close_matches(key, options, n=1, cutoff=0.75)
        elsewhere = difflib.get_close_matches(
            key, list(_OWNERS), n=1, cutoff=0.75
        )
        if close:
            hint = f"Did you mean `{close[0]}`?"
        elif elsewhere:
            owners = _owner_names(elsewhere[0])
            hint = (
                f"Did you mean `{elsewhere[0]}`? It is an option of "
                f"{owners}, which {cls.__name__} does not have: add it to "
                f"the bases of {cls.__name__}."
            )
        elif functional:
            hint = f"The options of {cls.__name__} are: {options}."
        else:
            continue
        raise ValueError(
            f"{cls.__name__} got an unknown keyword argument `{key}`. "
            f"{received} {hint}"
        )


def refuse_options_in_call(
    cls: type, call: str, kwargs: dict[str, Any]
) -> None:
    """Raises for an option of a mixin passed to `compile`, `fit` or the like.

    Keras users put training settings in `compile()` or `fit()`; a
    custom_fit option is set when the model is made (the step is built
    with it). Keras' own error for the keyword names neither the option nor
    the fix; this one does, before Keras sees the call.

    Args:
        cls: The model class.
        call: The method's name, as the message shows it (`"compile"`).
        kwargs: The keyword arguments of the call.

    Raises:
        TypeError: For a keyword that is the name of an option (of `cls`
            or of another mixin), naming the constructor call to use.
    """
    own = declared_options(cls)
    for key, value in kwargs.items():
        if key not in own and key not in _OWNERS:
            continue
        made = (
            f"{cls.__name__}(inputs, outputs, {key}={value!r}) for a "
            f"functional model, {cls.__name__}(..., {key}={value!r}) for "
            "your own"
        )
        if key in own:
            whose = f"an option of {cls.__name__}"
            fix = f"Pass it when you make the model: {made}."
        else:
            whose = f"an option of {_owner_names(key)}"
            fix = (
                f"{cls.__name__} does not have it among its bases: add the "
                f"mixin before the Keras class, then pass the option when "
                f"you make the model: {made}."
            )
        raise TypeError(
            f"`{key}` is {whose}, set when the model is made (its training "
            f"step is built with it), not an argument of `{call}()`. "
            f"Received: {call}({key}={value!r}). {fix}"
        )


def _missing_mixin(cls: type, key: str, received: str) -> str:
    """Says which mixin owns option `key` and how to add it to `cls`."""
    owners = _owner_names(key)
    first = _OWNERS[key][0]
    bases = [shown_class(first)] + [shown_class(base) for base in cls.__bases__]
    return (
        f"`{key}` is an option of {owners}, which {cls.__name__} does not "
        f"have among its bases. {received} Add the mixin to the bases "
        f"of the model, before the Keras class: class {cls.__name__}"
        f"({', '.join(bases)})."
    )


def _owner_names(key: str) -> str:
    """Names the classes that declare option `key`, as a user spells them."""
    return " or ".join(
        dict.fromkeys(shown_class(owner) for owner in _OWNERS[key])
    )


# How a user names Keras' base classes (`Functional` is what Keras puts in
# place of `keras.Model` in the bases of a model built from inputs).
_KERAS_NAMES = {
    "Model": "keras.Model",
    "Functional": "keras.Model",
    "Sequential": "keras.Sequential",
    "Layer": "keras.layers.Layer",
}


def shown_class(klass: type) -> str:
    """Returns how a user names `klass` in a class statement.

    `custom_fit.X` for custom_fit's classes, `keras.Model` and the like for
    Keras' base classes, else the class's name.
    """
    root = klass.__module__.split(".")[0]
    if root == "custom_fit":
        return f"custom_fit.{klass.__name__}"
    if root == "keras":
        return _KERAS_NAMES.get(klass.__name__, klass.__name__)
    return klass.__name__


def _is_functional_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Returns whether the arguments build a functional model, as in Keras."""
    return (
        len(args) == 2
        or (len(args) == 1 and "outputs" in kwargs)
        or ("inputs" in kwargs and "outputs" in kwargs)
    )


def store_options(
    instance: object, values: dict[str, Any], dtype: str = "float32"
) -> None:
    """Validates `values`, stores them on `instance`, checks them together.

    Args:
        instance: The model.
        values: Dict of option name to received value. Options missing
            from it keep their current value (the default at first).
        dtype: String. The model's variable dtype, in which the `bound`
            options must be finite and positive.

    Raises:
        ValueError: From the option's validator, naming the argument; or
            when an option set away from its default lacks the option it
            needs.
    """
    stored = _model_state.state_of(instance).options
    options = declared_options(type(instance))
    for name, option in options.items():
        if name not in values:
            continue
        value = values[name]
        if _validation.is_schedule(value):
            if not option.schedulable:
                schedulable = [
                    other for other, o in options.items() if o.schedulable
                ]
                raise ValueError(
                    f"`{name}` takes a fixed value, not a schedule. Received: "
                    f"{name}={type(value).__name__}(...). Pass a number; the "
                    f"options of {type(instance).__name__} that take a "
                    f"schedule are {schedulable}."
                )
            stored[name] = value
            continue
        stored[name] = option.validate(name, value)
        if option.bound:
            _validation.representable(name, stored[name], dtype)
    for name, option in options.items():
        _check_requirements(instance, name, option)


def without_former_defaults(
    cls: type, options: dict[str, Any]
) -> dict[str, Any]:
    """Returns saved `options` less former defaults that have no effect.

    See `Option(former_defaults=...)`: a model saved by an earlier version
    holds its options' defaults of then; one that would now be refused as
    having no effect is left out (the present default is taken).
    """
    declared = declared_options(cls)
    kept = dict(options)
    for name, value in options.items():
        option = declared.get(name)
        if option is None or not any(
            _same(value, old) for old in option.former_defaults
        ):
            continue
        if not _requirements_met(
            cls,
            option,
            lambda other: options.get(other, declared[other].default),
        ):
            del kept[name]
    return kept


def _requirements_met(
    cls: type, option: Option, value_of: Callable[[str], Any]
) -> bool:
    """Whether an option that `option` requires is set, or its capability.

    `value_of(name)` reads another option's value (of a model, or of a
    saved config); `cls` is the model's class.
    """
    defaults = _first_defaults(cls)
    if any(
        other in defaults and _counts_as_set(value_of(other), defaults[other])
        for other in option.requires
    ):
        return True
    capability = option.or_capability
    return bool(capability and getattr(cls, capability, False))


def _check_requirements(instance: object, name: str, option: Option) -> None:
    """Raises if `name` is missing, or set without or with another option.

    A `required` one must be given; one it `requires` must be set with it,
    none it `excludes`.
    """
    value = getattr(instance, name)
    if option.required and value is None:
        owner = option.owner.__name__ if option.owner else "The model"
        raise ValueError(
            f"{owner} needs `{name}`. Received: {name}=None. Pass it to "
            "the model's constructor."
        )
    if _same(value, option.default):
        return
    defaults = _first_defaults(type(instance))
    for other in option.excludes:
        if other in defaults and not _same(
            getattr(instance, other), defaults[other]
        ):
            raise ValueError(
                f"Pass only one of `{name}` and `{other}`. Received: "
                f"{name}={value!r}, {other}={getattr(instance, other)!r}. "
                f"Leave one of them out."
            )
    if not option.requires:
        return
    if _requirements_met(
        type(instance), option, lambda other: getattr(instance, other)
    ):
        return
    received = ", ".join(
        f"{other}={getattr(instance, other, None)!r}"
        for other in option.requires
    )
    needed = " or ".join(f"`{other}`" for other in option.requires)
    if option.or_capability:
        needed += " (or a mixin that uses it)"
    raise ValueError(
        f"`{name}` has no effect without {needed}. Received: "
        f"{name}={value!r}, {received}. Set {needed.split(' or ')[0]} too, "
        f"or leave `{name}` out."
    )


def _same(value: Any, default: Any) -> bool:
    """Returns whether an option value equals its default."""
    if isinstance(value, (list, tuple)) and isinstance(default, (list, tuple)):
        return tuple(value) == tuple(default)
    return value is default or value == default


def _is_set(value: Any) -> bool:
    """Returns whether an option counts as set (not `None` nor `False`)."""
    return value is not None and value is not False


def _owner_of_init(cls: type) -> type:
    """Returns the class of the MRO whose `__init__` `cls` uses."""
    return next(klass for klass in cls.__mro__ if "__init__" in vars(klass))


def saved_options(cls: type) -> list[str]:
    """Returns the names of the options of `cls` that `get_config` keeps."""
    return [name for name, option in _declared(cls) if option.saved]


def to_config(value: Any) -> Any:
    """Returns an option's value as `get_config()` holds it.

    A schedule is serialized as Keras serializes objects; other values are
    kept.
    """
    if _validation.is_schedule(value):
        return keras.saving.serialize_keras_object(value)
    return value


def from_config(value: Any) -> Any:
    """Returns an option's value from `get_config()` (see `to_config`)."""
    if isinstance(value, dict) and "class_name" in value:
        return keras.saving.deserialize_keras_object(value)
    return value


def signature(cls: type) -> inspect.Signature:
    """Returns the constructor signature of `cls`, options included.

    The positional and keyword parameters of `cls.__init__` come first,
    then each option as a keyword-only parameter with its default, then
    `**kwargs`, so that `inspect.signature(Net)` and `help(Net)` show the
    keywords a custom_fit model accepts.

    Args:
        cls: A model class deriving from a custom_fit mixin.

    Returns:
        An `inspect.Signature`.
    """
    init = inspect.signature(vars(_owner_of_init(cls))["__init__"])
    parameters = list(init.parameters.values())[1:]  # without `self`
    variadic = [p for p in parameters if p.kind is p.VAR_KEYWORD]
    if not variadic:
        return init.replace(parameters=parameters)
    head = [p for p in parameters if p.kind is not p.VAR_KEYWORD]
    taken = {p.name for p in head}
    options = [
        inspect.Parameter(
            name, inspect.Parameter.KEYWORD_ONLY, default=option.default
        )
        for name, option in declared_options(cls).items()
        if name not in taken
    ]
    return init.replace(parameters=head + options + variadic)
