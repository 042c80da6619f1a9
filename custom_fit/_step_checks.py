"""Checks of a model's step: overrides, transform outputs, optimizers.

Each raises a `ValueError` that names what it received and the fix, as
early as it can: a step override at construction, the output of
`transform_gradients` at trace time, an optimizer when an update starts.
"""

import functools
import inspect
from collections.abc import Sequence
from typing import Any

import keras

from custom_fit import _gradient_ops
from custom_fit import _options
from custom_fit import _validation
from custom_fit import backend
from custom_fit import pipeline
from custom_fit._types import Gradients
from custom_fit._types import Optimizer
from custom_fit._types import Variable


def refuse_stateless_step_overrides(cls: type, base: type) -> None:
    """Raises if `cls` overrides a step in the form of Keras' JAX trainer.

    Keras' JAX trainer calls `train_step(state, data)`; custom_fit runs one
    stateful `train_step(data)` on every backend and carries the state
    itself, so such an override would fail deep inside the step.

    Args:
        cls: The model class.
        base: The base of custom_fit models (`_configuring.Configured`):
            overrides in classes derived from it count.

    Raises:
        ValueError: Naming the override and showing the one-argument form.
    """
    for name in ("train_step", "test_step"):
        owner = next(k for k in cls.__mro__ if name in vars(k))
        if not issubclass(owner, base):
            continue
        parameters = [
            p
            for p in inspect.signature(vars(owner)[name]).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
            and p.default is p.empty
        ]
        if len(parameters) <= 2:  # self, data
            continue
        listed = ", ".join(p.name for p in parameters)
        raise ValueError(
            f"custom_fit models take `{name}(self, data)` on every backend "
            "and carry the model's state themselves; the form "
            f"`{name}(self, state, data)` is that of Keras' JAX trainer. "
            f"Received: {owner.__name__}.{name}({listed}). Override "
            f"`{name}(self, data)` and call `super().{name}(data)` "
            "inside it."
        )


# The packages whose classes hold Keras' own `train_step` (its models and
# trainers, and the models built on them, such as keras-hub's tasks).
_KERAS_PACKAGES = ("keras", "keras_hub", "keras_nlp", "keras_cv")


def refuse_keras_before_mixins(cls: type, base: type) -> None:
    """Raises if a Keras class comes before the custom_fit mixins in `cls`.

    Python looks methods up along the MRO: with `keras.Model` (or another
    Keras class) first, Keras' `__init__` and `train_step` run and the
    mixins never do, so their options are dropped and training runs as
    plain Keras without a word.

    Args:
        cls: The class being created.
        base: `TrainStepMixin`.

    Raises:
        TypeError: Naming the Keras class that comes first and showing the
            class statement in the right order.
    """
    mro = cls.__mro__
    first = next(
        (
            klass
            for klass in mro[: mro.index(base)]
            if not issubclass(klass, base)
            and klass.__module__.split(".")[0] in _KERAS_PACKAGES
        ),
        None,
    )
    if first is None:
        return
    ours = [b for b in cls.__bases__ if issubclass(b, base)]
    others = [b for b in cls.__bases__ if not issubclass(b, base)]
    received = ", ".join(_options.shown_class(b) for b in cls.__bases__)
    fixed = ", ".join(_options.shown_class(b) for b in ours + others)
    raise TypeError(
        f"`{cls.__name__}` puts the Keras class `{first.__name__}` before "
        "the custom_fit mixins in its bases, so Keras' own `__init__` and "
        "`train_step` would run and the mixins' options and hooks would be "
        f"ignored. Received: class {cls.__name__}({received}). Put the "
        f"custom_fit mixins first: class {cls.__name__}({fixed})."
    )


# Public attributes Keras sets on a model instance (not on its class).
_KERAS_INSTANCE_ATTRIBUTES = frozenset(
    (
        "activity_regularizer",
        "autocast",
        "built",
        "compiled",
        "loss",
        "name",
        "optimizer",
        "output_names",
        "steps_per_execution",
        "stop_training",
        "supports_jit",
        "trainable",
    )
)


def refuse_options_hiding_keras(cls: type) -> None:
    """Raises if an option of `cls` has the name of a Keras attribute.

    An option is a class attribute: one named as a Keras model attribute
    (`name`, `optimizer`, `loss`) would hide it from Keras itself.

    Raises:
        TypeError: Naming the option, its class and the Keras class.
    """
    keras_classes = [
        klass
        for klass in cls.__mro__
        if klass.__module__.split(".")[0] in _KERAS_PACKAGES
    ]
    declared = {
        **_options.declared_options(cls),
        **_options.declared_states(cls),
    }
    for name, option in declared.items():
        if name in _KERAS_INSTANCE_ATTRIBUTES or any(
            hasattr(klass, name) for klass in keras_classes
        ):
            owner = getattr(option, "owner", None) or cls
            kind = type(option).__name__
            raise TypeError(
                f"The {kind.lower()} `{name}` of {owner.__name__} has the "
                "name of an attribute of Keras models, which it would hide. "
                f"Received: {owner.__name__}.{name} = {kind}(...). Give it "
                "another name."
            )


def check_declared_options(cls: type) -> None:
    """Raises for an option or state declared twice, or naming no option.

    An option declared again by a class that does not derive from the
    first declarer would hide the first declaration from the mixin that
    reads it (its `kind`, its validator); `requires`
    and `excludes` naming an option no class declares is a typo that would
    make the check pass or fail for nothing.

    Raises:
        TypeError: Naming the option, the classes and the fix.
    """
    owners: dict[tuple[str, str], type] = {}
    for klass in reversed(cls.__mro__):
        for name, attribute in vars(klass).items():
            if isinstance(attribute, _options.Option):
                kind = "option"
            elif isinstance(attribute, _options.State):
                kind = "state"
            else:
                continue
            first = owners.get((kind, name))
            if first is not None and not issubclass(klass, first):
                # A subclass may narrow its base's option (PCGradMixin's
                # `per_loss_gradients`); another mixin may not hide it, nor
                # replace a state (DP-SGD's noise generator, the guard's
                # counter) for the mixin that reads it.
                raise TypeError(
                    f"{klass.__name__} declares the {kind} `{name}`, which "
                    f"{_options.shown_class(first)} declares already: the "
                    "second would hide the first from the mixin that reads "
                    f"it. Received: {klass.__name__}.{name} = "
                    f"{type(attribute).__name__}(...). Give your {kind} "
                    "another name."
                )
            owners[(kind, name)] = klass
            if kind == "state":
                continue
            _check_default(klass, name, attribute)
            if not _is_model_class(cls):
                # Options named may be declared by mixins defined later.
                continue
            for argument in ("requires", "excludes"):
                unknown = [
                    other
                    for other in getattr(attribute, argument)
                    if not _options.is_option_name(other)
                ]
                if unknown:
                    raise TypeError(
                        f"The option `{name}` of {klass.__name__} {argument} "
                        f"options that no class declares: {unknown}. "
                        f"Received: {argument}={getattr(attribute, argument)}. "
                        "Name declared options only."
                    )
    if not _is_model_class(cls):
        return
    options = _options.declared_options(cls)
    for name, seeds in _options.declared_states(cls).items():
        if not isinstance(seeds, _options.Seeds):
            continue
        option = seeds.seed_option
        if option not in options:
            raise TypeError(
                f"The seed generator `{name}` of {cls.__name__} is seeded "
                f"by the option `{option}`, which no class of the model "
                f"declares. Received: Seeds({option!r}). Declare the "
                f"option (`{option} = options.Option(None, "
                "options.seed_or_none)`) or name a declared one."
            )


def _is_model_class(cls: type) -> bool:
    """Returns whether `cls` derives from a Keras class: a model, no mixin."""
    return any(
        klass.__module__.split(".")[0] in _KERAS_PACKAGES
        for klass in cls.__mro__
    )


def _check_default(klass: type, name: str, option: Any) -> None:
    """Raises if an option's default (other than `None`) fails its check."""
    default = option.default
    if default is None or (
        option.schedulable and _validation.is_schedule(default)
    ):
        return
    try:
        option.validate(name, default)
    except ValueError as error:
        raise TypeError(
            f"The default of the option `{name}` of {klass.__name__} is "
            f"refused by its own validator: {error}"
        ) from None


def checked_step(step: Any, kind: str) -> Any:
    """Wraps a user's `train_step` or `test_step` with checks of its result.

    A step that returns no figure at all is refused on every backend (on
    TensorFlow Keras fails on it with an error of its own ops), and a
    network without `minimize` (a plain `keras.Model`) called as a
    custom_fit one gets the fix in its message.

    Args:
        step: The function the class defines.
        kind: `"train_step"` or `"test_step"`.

    Returns:
        The wrapped function.
    """

    @functools.wraps(step)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            logs = step(self, *args, **kwargs)
        except AttributeError as error:
            raise _with_fix(self, error) from error
        if isinstance(logs, dict) and not logs:
            raise ValueError(
                f"{type(self).__name__}.{kind} returned no logs: nothing "
                "would reach the progress bar, History or callbacks "
                "(and TensorFlow cannot run a step that returns none). "
                "Received: {}. Report the step's losses with "
                "self.report_metric('d_loss', loss) and return "
                "self.get_metrics_result()."
            )
        return logs

    checked.custom_fit_checked = True  # type: ignore[attr-defined]
    return checked


def _with_fix(model: Any, error: AttributeError) -> AttributeError:
    """Returns `error`, or with the fix for a network without `minimize`."""
    network = getattr(error, "obj", None)
    if getattr(error, "name", None) != "minimize" or not isinstance(
        network, keras.Model
    ):
        return error
    # The attribute that holds it (`dir` lists those a backend's layer
    # keeps outside the instance's `__dict__` too).
    attribute = next(
        (
            name
            for name in dir(model)
            if not name.startswith("_")
            and not hasattr(type(model), name)
            and getattr(model, name, None) is network
        ),
        None,
    )
    shown = (
        f"self.{attribute}" if attribute else f"the network {network.name!r}"
    )
    variables = f"self.{attribute}" if attribute else "network"
    return AttributeError(
        f"`{shown}` is a plain keras.Model ({type(network).__name__}), which "
        f"has no `minimize`. Received: {network.name!r}. Build it from a "
        "custom_fit mixin, so that it gets its own options and hooks (class "
        "Generator(custom_fit.TrainStepMixin, keras.Model)), or update it "
        "through this model: self.minimize(loss_function, variables="
        f"{variables}.trainable_variables, optimizer=...)."
    )


def check_transformed(
    gradients: Gradients, transformed: Any, variables: Sequence[Variable]
) -> None:
    """Raises if `transform_gradients` returned no gradient list for them.

    Runs at trace time, where lengths and static shapes are known.
    """
    if not isinstance(transformed, (list, tuple)):
        raise ValueError(
            "`transform_gradients` must return a list of gradients aligned "
            f"with the variables. Received: {type(transformed).__name__} "
            f"{transformed!r}. Return the list, e.g. the result of "
            "`super().transform_gradients(gradients, variables)`."
        )
    if len(transformed) != len(variables):
        missing = [v.path for v in variables[len(transformed) :]]
        raise ValueError(
            "`transform_gradients` must return one gradient per variable. "
            f"Received: {len(transformed)} gradients for {len(variables)} "
            "variables"
            + (f"; no gradient for {missing}" if missing else "")
            + ". Return a list aligned with `variables` (None for a "
            "variable that has no gradient)."
        )
    for before, after, variable in zip(gradients, transformed, variables):
        if after is None and before is not None:
            raise ValueError(
                "`transform_gradients` returned None for the variable "
                f"{variable.path!r}, which has a gradient: it would not be "
                "trained. Received: None. Return a gradient (zeros to leave "
                "it unchanged by the optimizer's step)."
            )
        if after is None or _gradient_ops.is_sparse(after):
            continue
        shape = getattr(after, "shape", None)
        shape = None if shape is None else tuple(shape)
        if shape is None or not compatible(shape, variable.shape):
            raise ValueError(
                "`transform_gradients` returned a gradient of shape "
                f"{shape} for the variable {variable.path!r} of shape "
                f"{tuple(variable.shape)}. Received: {after!r}. Return one "
                "gradient of the variable's shape per variable."
            )


def compatible(shape: tuple, expected: tuple) -> bool:
    """Returns whether two static shapes agree where both are known."""
    return len(shape) == len(expected) and all(
        a is None or b is None or a == b for a, b in zip(shape, expected)
    )


def checked_optimizer(model: Any, optimizer: Optimizer | None) -> Optimizer:
    """Returns the optimizer of an update (`model`'s by default), checked.

    Raises:
        ValueError: Without an optimizer, or for one that accumulates
            gradients itself.
    """
    optimizer = optimizer or getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(
            "`minimize` needs an optimizer. Received: optimizer=None and "
            f"the model {model.name!r} has none. Compile the model, or "
            "pass optimizer=... to `minimize`."
        )
    refuse_accumulating_optimizer(optimizer)
    return optimizer


def refuse_accumulating_optimizer(optimizer: Optimizer) -> None:
    """Raises for an optimizer that accumulates gradients itself.

    Raises:
        ValueError: Naming its `gradient_accumulation_steps` and the
            model's option to use instead.
    """
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    steps = max(
        (
            getattr(member, "gradient_accumulation_steps", None) or 0
            for member in [inner, *getattr(inner, "optimizers", [])]
        ),
        default=0,
    )
    if steps:
        raise ValueError(
            "The optimizer accumulates gradients itself, after "
            "custom_fit's transforms, so clipping and inspection would "
            "act on each micro-batch instead of the accumulated "
            "gradient. Received: optimizer with "
            f"gradient_accumulation_steps={steps}. Remove it from the "
            "optimizer and pass gradient_accumulation_steps="
            f"{steps} to the model's constructor instead."
        )


def warn_about_optimizer_clipping(model: Any, optimizer: Optimizer) -> None:
    """Warns once if the optimizer's own clipping is wrong or redundant."""
    found = pipeline.optimizer_clipping(optimizer)
    twice = _options.any_set(model, "clipping")
    if not found or not (twice or backend.current().replica_count() > 1):
        return
    model._warn_once(
        "optimizer_clipping",
        f"The optimizer clips gradients itself ({_format(found)})."
        + (
            " custom_fit already clips them, so they are clipped twice."
            if twice
            else ""
        )
        + " Under tf.distribute, Keras' optimizer-level clipping acts on "
        "each replica's share of the gradient, before the replicas are "
        "summed, so it does not clip the gradient of the global batch. "
        "Remove the clipping arguments from the optimizer and pass them "
        "to custom_fit.GradientClippingMixin instead.",
    )


def _format(arguments: dict[str, Any]) -> str:
    """Formats a dict as `name=value, ...`."""
    return ", ".join(f"{name}={value}" for name, value in arguments.items())
