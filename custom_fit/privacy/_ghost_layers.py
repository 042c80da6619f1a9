"""Which layers ghost clipping handles, what it records, and their terms.

`DifferentialPrivacyMixin` clips without per-example gradients when every
variable it trains belongs to a layer listed here (`blocker` says why
not, naming the layer). During the step's one forward pass, `recording`
wraps each such layer's `call` (an attribute of the instance, restored
afterwards): the layer's activation is held back, so that the tensor
marked (`watch`) is the pre-activation output, whose gradient, with the
layer's inputs, gives every weight's per-example gradient as a
`custom_fit.ghost` term (`terms`).

A layer with trainable weights of a class not listed (a
LayerNormalization, a custom layer) is recorded whole when all its
weights are its own (`whole_problem`): its inputs and its output are
recorded, and each example's gradient of its weights alone is computed
from them (`custom_fit.per_example`), so that one such layer does not
send the whole model to per-example gradients.

The rules rest on each example's output depending only on its own inputs
(DP already refuses BatchNormalization) and on each weight being read
only by its layer's own `call`. Code that Keras did not write could read
a weight elsewhere (a custom layer holding a Dense and reading its
kernel), which ghost norms would miss: `clipping_method="auto"` therefore
falls back to per-example gradients for models whose supported layers are
called from a custom layer or model (`call` written outside Keras) or
beside a `Lambda`; `clipping_method="ghost"` trusts that code.
"""

import contextlib
import dataclasses
import threading
from collections.abc import Callable
from collections.abc import Iterator
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
from keras import ops

from custom_fit import _keras_compat
from custom_fit.privacy import ghost

KERNEL_LAYERS = (
    keras.layers.Dense,
    keras.layers.EinsumDense,
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
)
TABLE_LAYERS = (keras.layers.Embedding,)
SUPPORTED = KERNEL_LAYERS + TABLE_LAYERS
SUPPORTED_NAMES = ", ".join(c.__name__ for c in SUPPORTED)
_KERNEL_ROLES = ("kernel", "bias", "lora_kernel_a", "lora_kernel_b")
_TABLE_ROLES = ("embeddings", "lora_embeddings_a", "lora_embeddings_b")
# Keras layers that call their supported sublayers on whole batches.
_BATCH_CALLERS = (keras.layers.MultiHeadAttention,)


@dataclasses.dataclass(frozen=True)
class Replay:
    """What a layer recorded whole was called with, to run it again.

    Attributes:
        args: The positional arguments of its `call`.
        kwargs: The keyword arguments.
    """

    args: tuple
    kwargs: dict

    def tensors(self) -> list[Any]:
        """Returns the tensors among the arguments, in a fixed order."""
        return [t for t in self._leaves() if ops.is_tensor(t)]

    def with_tensors(self, tensors: Sequence[Any]) -> "Replay":
        """Returns the same call with `tensors` in place of `tensors()`."""
        given = iter(tensors)
        leaves = [
            next(given) if ops.is_tensor(t) else t for t in self._leaves()
        ]
        args, kwargs = keras.tree.pack_sequence_as(
            (self.args, self.kwargs), leaves
        )
        return Replay(tuple(args), dict(kwargs))

    def _leaves(self) -> list[Any]:
        return keras.tree.flatten((self.args, self.kwargs))


def is_whole(layer: Any) -> bool:
    """Whether `layer` is recorded whole (no ghost norm of its class)."""
    return type(layer) not in SUPPORTED


def blocker(model: Any, variables: Sequence[Any], trust_code: bool) -> str:
    """Returns why ghost clipping cannot train `variables`; `""` if it can.

    Args:
        model: The model.
        variables: The variables the step differentiates.
        trust_code: Bool. Accept supported layers called from code Keras
            did not write (`clipping_method="ghost"`).

    Returns:
        A sentence naming the first layer in the way, or `""`.
    """
    layers = _keras_compat.all_layers(model)
    owners = _owners(layers)
    holders = _holders(layers)
    contents: dict[int, list[Any]] = {}

    def inside(layer: Any) -> list[Any]:
        if id(layer) not in contents:
            contents[id(layer)] = _keras_compat.all_layers(layer)
        return contents[id(layer)]

    for variable in variables:
        owner = owners.get(id(variable))
        if owner is None:
            holder = _innermost_holder(holders.get(id(variable), []))
            reason = whole_problem(holder)
            if reason:
                named = "the model" if holder is None else _named(holder)
                return (
                    f"the variable {variable.path!r} belongs to {named}, "
                    f"which has no ghost norm (only {SUPPORTED_NAMES} and "
                    "their LoRA weights have), and whose per-example "
                    f"gradients cannot be computed alone: {reason}"
                )
            owners[id(variable)] = owner = holder
        else:
            reason = layer_problem(owner)
            if reason:
                return f"the layer {_named(owner)} {reason}"
        # A weight read by two layers, neither inside the other: the
        # recorded calls of its owner would miss the other's reads.
        for other in holders.get(id(variable), []):
            if other is not owner and owner not in inside(other):
                return (
                    f"the variable {variable.path!r} is a weight of the "
                    f"layers {_named(owner)} and {_named(other)}, neither "
                    "inside the other (a weight shared across layers)"
                )
    for layer in [model, *layers]:
        reason = _other_problem(layer, owners, trust_code)
        if reason:
            return reason
    return ""


def whole_problem(layer: Any) -> str:
    """Returns why `layer` cannot be recorded whole; `""` if it can.

    Its per-example gradients are computed by running its call again on
    each example's inputs: its weights must be its own (no layer with
    trainable weights inside it), its call must repeat (no random draws
    from a seed generator, its own or a sublayer's), update nothing, and
    make no mask the loss could read.

    Args:
        layer: The innermost layer holding a variable to clip, or `None`
            (a weight of the model itself).
    """
    if layer is None:
        return "it is a weight of the model itself, outside any layer"
    inner = _keras_compat.all_layers(layer)
    weighted = [s for s in inner if s.trainable_variables]
    if weighted:
        return (
            f"it holds layers with trainable weights ({_named(weighted[0])}),"
            " whose calls inside it are not recorded one by one"
        )
    for owner in [layer, *inner]:
        if any(
            isinstance(v, keras.random.SeedGenerator)
            for v in vars(owner).values()
        ):
            return (
                "it draws random numbers in its call, which a second run "
                "for each example would not repeat"
            )
    if layer.non_trainable_variables:
        return (
            "it has non-trainable weights, which a second run of its call "
            "for each example could update again"
        )
    if getattr(layer, "mask_zero", False):
        return "it makes a mask (mask_zero=True), which the loss would read"
    overrides = type(layer).compute_mask is not keras.layers.Layer.compute_mask
    if overrides and not isinstance(layer, keras.layers.Embedding):
        return (
            "it computes a mask of its own (compute_mask), which the loss "
            "could read"
        )
    return ""


def whole_layers(model: Any, variables: Sequence[Any]) -> list[Any]:
    """Returns the layers owning `variables` that are recorded whole."""
    return [
        layer for layer in layers_to_record(model, variables) if is_whole(layer)
    ]


def layer_problem(layer: Any) -> str:
    """Returns why a layer of a supported class is not handled; `""`."""
    if getattr(layer, "quantization_mode", None) is not None:
        return f"is quantized ({layer.quantization_mode!r})"
    roles = _TABLE_ROLES if isinstance(layer, TABLE_LAYERS) else _KERNEL_ROLES
    unknown = [v.name for v in layer.variables if v.name not in roles]
    if unknown:
        return f"has weights ghost clipping does not know: {unknown}"
    if getattr(layer, "groups", 1) != 1:
        return f"is a grouped convolution (groups={layer.groups})"
    if isinstance(layer, keras.layers.Embedding) and layer.mask_zero:
        return "makes a mask (mask_zero=True), which the loss would read"
    if isinstance(layer, keras.layers.EinsumDense):
        return _equation_problem(layer.equation)
    return ""


def _equation_problem(equation: str) -> str:
    """Returns why an EinsumDense equation is not handled; `""`."""
    inputs, rest = equation.split(",")
    kernel, outputs = rest.split("->")
    if inputs.startswith("..."):
        return ""
    if not outputs or inputs[0] != outputs[0] or inputs[0] in kernel:
        return (
            f"has the equation {equation!r}, whose first axis is not the "
            "example's (the first letter of its input and output, not in "
            "its kernel)"
        )
    return ""


def _other_problem(layer: Any, owners: dict[int, Any], trust_code: bool) -> str:
    """Returns why a layer owning no clipped variable is in the way."""
    if getattr(layer, "activity_regularizer", None) is not None:
        return (
            f"the layer {_named(layer)} has an activity regularizer, a loss "
            "of each example's activations whose gradient is no product of "
            "a layer's inputs and output gradients"
        )
    if isinstance(layer, keras.layers.Masking):
        return f"the layer {_named(layer)} makes a mask, which the loss reads"
    if trust_code or isinstance(layer, SUPPORTED):
        return ""
    if isinstance(layer, keras.layers.Lambda):
        return (
            f"the layer {_named(layer)} runs code that could read a weight "
            "outside its layer's call (pass clipping_method='ghost' if it "
            "reads none)"
        )
    inner = _keras_compat.all_layers(layer)
    if any(id(v) in owners for s in inner for v in s.variables):
        if isinstance(layer, _BATCH_CALLERS) or (
            isinstance(layer, keras.Model) and _written_by_keras(layer)
        ):
            return ""
        return (
            f"the layer {_named(layer)} calls layers whose weights are "
            "clipped from code Keras did not write, which could read their "
            "weights elsewhere "
            "or call them on other than whole batches (pass "
            "clipping_method='ghost' if it does neither)"
        )
    return ""


def _written_by_keras(layer: Any) -> bool:
    """Whether the layer's `call` is Keras' own (a functional model's)."""
    module = getattr(type(layer).call, "__module__", "") or ""
    return module.startswith("keras.")


def _owners(layers: list[Any]) -> dict[int, Any]:
    """Returns `id(variable) -> layer` for the supported layers' weights."""
    owners = {}
    for layer in layers:
        if type(layer) in SUPPORTED:
            for variable in layer.variables:
                owners[id(variable)] = layer
    return owners


def _holders(layers: list[Any]) -> dict[int, list[Any]]:
    """Returns `id(variable) -> the layers holding it`, at any depth."""
    holders: dict[int, list[Any]] = {}
    for layer in layers:
        for variable in layer.variables:
            holders.setdefault(id(variable), []).append(layer)
    return holders


def _innermost_holder(holding: list[Any]) -> Any:
    """Returns the innermost of the layers holding a variable; `None` if none.

    Of the holders with the fewest variables, the one inside the others
    (a wrapper holding only that layer has as many).

    Args:
        holding: The layers holding the variable (`_holders`).
    """
    if not holding:
        return None
    fewest = min(len(layer.variables) for layer in holding)
    candidates = [h for h in holding if len(h.variables) == fewest]
    for candidate in candidates:
        inside = _keras_compat.all_layers(candidate)
        if not any(
            other is not candidate and any(s is other for s in inside)
            for other in candidates
        ):
            return candidate
    return candidates[0]


def _named(layer: Any) -> str:
    return f"{layer.name!r} ({type(layer).__name__})"


def layers_to_record(model: Any, variables: Sequence[Any]) -> list[Any]:
    """Returns the layers owning `variables`: supported, or recorded whole.

    `blocker` has accepted `variables`.
    """
    layers = _keras_compat.all_layers(model)
    owners = _owners(layers)
    holders = _holders(layers)
    found = {}
    for variable in variables:
        layer = owners.get(id(variable))
        if layer is None:
            layer = _innermost_holder(holders.get(id(variable), []))
        if layer is not None:
            found[id(layer)] = layer
    return list(found.values())


class _Recording:
    """One thread's recording: its `watch`, its calls, its layers."""

    def __init__(
        self, layers: Sequence[Any], watch: Callable[[Any], Any]
    ) -> None:
        self.watch = watch
        self.calls: list[tuple[Any, Any]] = []
        self.problems: list[str] = []
        self.layers = {id(layer) for layer in layers}
        self.held: set[int] = set()  # layers whose activation is held back


# The recording of each thread (MirroredStrategy traces each replica in a
# thread of its own), and how many recordings use each layer's wrappers.
_LOCAL = threading.local()
_LOCK = threading.Lock()
_USERS: dict[int, int] = {}


def _active() -> "_Recording | None":
    return getattr(_LOCAL, "recording", None)


@contextlib.contextmanager
def recording(
    layers: Sequence[Any], watch: Callable[[Any], Any]
) -> Iterator[_Recording]:
    """Records each call of `layers`: its inputs, and its output watched.

    Inside the context, each supported layer's `call` runs the original
    with the activation held back, passes the result through `watch`,
    then applies the activation; a layer recorded whole (`is_whole`) has
    its whole output watched, and its arguments kept (`Replay`). The
    context's value has `calls`, the list of `(layer, inputs)` in the
    order of the calls, which is the order of the watched tensors, and
    `problems`, sentences saying why a call cannot be used.

    The layers' `call` and `activation` are replaced on the instances
    (restored when the last recording using them ends) by wrappers that
    record only in the thread of a recording that lists the layer; any
    other call runs as before.

    Args:
        layers: Layers of the supported classes.
        watch: Callable marking a tensor (see
            `custom_fit.backend.Adapter.intermediate_gradients`).

    Yields:
        The recording, filled as the layers run.
    """
    layers = list({id(layer): layer for layer in layers}.values())
    active = _Recording(layers, watch)
    previous = _active()
    _LOCAL.recording = active
    with _LOCK:
        for layer in layers:
            if not _USERS.get(id(layer)):
                _wrap(layer)
            _USERS[id(layer)] = _USERS.get(id(layer), 0) + 1
    try:
        yield active
    finally:
        _LOCAL.recording = previous
        with _LOCK:
            for layer in layers:
                _USERS[id(layer)] -= 1
                if not _USERS[id(layer)]:
                    del _USERS[id(layer)]
                    _unwrap(layer)


def _wrap(layer: Any) -> None:
    """Puts the recording `call` (and activation) on the instance."""
    original = type(layer).call.__get__(layer)
    if is_whole(layer):
        object.__setattr__(layer, "call", _whole_call(layer, original))
        return
    activation = getattr(layer, "activation", None)

    def call(*args: Any, **kwargs: Any) -> Any:
        active = _active()
        if active is None or id(layer) not in active.layers:
            return original(*args, **kwargs)
        active.held.add(id(layer))
        try:
            outputs = original(*args, **kwargs)
        finally:
            active.held.discard(id(layer))
        active.calls.append((layer, args[0] if args else kwargs["inputs"]))
        outputs = active.watch(outputs)
        return outputs if activation is None else activation(outputs)

    def held_back(outputs: Any) -> Any:
        active = _active()
        if active is not None and id(layer) in active.held:
            return outputs
        return activation(outputs)  # type: ignore[misc]

    object.__setattr__(layer, "call", call)
    if activation is not None:
        object.__setattr__(layer, "activation", held_back)
        object.__setattr__(layer, "_custom_fit_activation", activation)


# The keyword arguments of a call recorded whole that are sliced per
# example beside its inputs: the mask Keras passes along.
_PER_EXAMPLE_KEYWORDS = ("mask",)
_PLAIN = (bool, int, float, str, np.ndarray)


def _whole_call(layer: Any, original: Callable[..., Any]) -> Any:
    """The recording `call` of a layer recorded whole."""

    def call(*args: Any, **kwargs: Any) -> Any:
        active = _active()
        if active is None or id(layer) not in active.layers:
            return original(*args, **kwargs)
        outputs = original(*args, **kwargs)
        problem = _replay_problem(layer, args, kwargs, outputs)
        if problem:
            active.problems.append(problem)
            return outputs
        active.calls.append((layer, Replay(tuple(args), dict(kwargs))))
        return active.watch(outputs)

    return call


def _replay_problem(layer: Any, args: tuple, kwargs: dict, outputs: Any) -> str:
    """Says why a call cannot be run again per example; `""` if it can.

    Its inputs (the first argument) and Keras' `mask` are sliced per
    example; any other tensor could be a constant that is not (a table of
    as many rows as the batch has examples), and an object holding a
    tensor would not be sliced at all: refused, as is an output that is
    not one tensor.
    """
    if not ops.is_tensor(outputs):
        return (
            f"the layer {_named(layer)} returned a {type(outputs).__name__}, "
            "not one tensor, so its per-example gradients are not computed "
            "alone"
        )
    extra = [f"argument {i}" for i, a in enumerate(args[1:], 1) if _held(a)]
    extra += [
        f"{name}="
        for name, value in kwargs.items()
        if name not in _PER_EXAMPLE_KEYWORDS and _held(value)
    ]
    if extra:
        return (
            f"the layer {_named(layer)} was called with tensors beside its "
            f"inputs ({', '.join(extra)}), which may not be per-example, so "
            "its per-example gradients are not computed alone"
        )
    leaves = keras.tree.flatten((args, kwargs))
    odd = [
        type(leaf).__name__
        for leaf in leaves
        if leaf is not None
        and not ops.is_tensor(leaf)
        and not isinstance(leaf, _PLAIN)
    ]
    if odd:
        return (
            f"the layer {_named(layer)} was called with an argument of type "
            f"{odd[0]}, which a second run for each example could not slice"
        )
    return ""


def _held(value: Any) -> bool:
    """Whether `value` is, or holds, a tensor or a variable."""
    return any(
        ops.is_tensor(leaf) or isinstance(leaf, keras.Variable)
        for leaf in keras.tree.flatten(value)
    )


def _unwrap(layer: Any) -> None:
    """Restores the layer's own `call` and activation."""
    object.__delattr__(layer, "call")
    activation = vars(layer).pop("_custom_fit_activation", None)
    if activation is not None:
        object.__setattr__(layer, "activation", activation)


def call_problem(layer: Any, inputs: Any, batch_size: Any) -> str:
    """Returns why one recorded call cannot be used; `""` if it can.

    Checked where shapes are static: the inputs' first axis must be the
    batch's examples (a layer called on a reshaped batch, `(examples *
    positions, ...)`, would mix them), and a convolution's spatial sizes
    must be known (its patches are cut at trace time); a layer recorded
    whole must have been given tensors, each with the examples first.
    """
    if isinstance(inputs, Replay):
        tensors = inputs.tensors()
        if not tensors:
            return f"the layer {_named(layer)} was called without a tensor"
        shapes = [tuple(t.shape) for t in tensors]
        known = isinstance(batch_size, int)
        if any(
            not s or (known and s[0] not in (None, batch_size)) for s in shapes
        ):
            return (
                f"the layer {_named(layer)} was called on tensors of shapes "
                f"{shapes}, not each with the batch's {batch_size} examples "
                "first"
            )
        return ""
    first = inputs.shape[0]
    if isinstance(batch_size, int) and first not in (None, batch_size):
        return (
            f"the layer {_named(layer)} was called on a tensor whose first "
            f"axis ({first}) is not the batch's examples ({batch_size})"
        )
    if isinstance(layer, KERNEL_LAYERS[2:]) and None in inputs.shape[1:]:
        return (
            f"the convolution {_named(layer)} was called on inputs of "
            f"shape {tuple(inputs.shape)}, whose spatial sizes are not "
            "known when the step is traced"
        )
    return ""


def terms(
    layer: Any, inputs: Any, gradient: Any, wanted: set[int]
) -> dict[int, list[ghost.Term]]:
    """Returns the terms of one call's weights in `wanted` (by `id`).

    Args:
        layer: A layer of a supported class.
        inputs: The inputs of the call.
        gradient: The gradient of the loss with respect to its output
            before the activation (not loss-scaled).
        wanted: Ids of the variables to describe.

    Returns:
        A dict of variable id to a list with its term.
    """
    if isinstance(layer, keras.layers.Embedding):
        found = _table_terms(layer, inputs, gradient)
    else:
        found = _kernel_terms(layer, inputs, gradient)
    by_name = {v.name: v for v in layer.variables}
    return {
        id(by_name[name]): [term]
        for name, term in found.items()
        if name in by_name and id(by_name[name]) in wanted
    }


def _kernel_terms(layer: Any, inputs: Any, gradient: Any) -> dict[str, Any]:
    """The terms of a Dense, EinsumDense or convolution call."""
    if isinstance(layer, keras.layers.Dense):
        kernel, bias = _dense(inputs, gradient)
    elif isinstance(layer, keras.layers.EinsumDense):
        kernel, bias = _einsum_dense(layer, inputs, gradient)
    else:
        kernel, bias = _convolution(layer, inputs, gradient)
    found: dict[str, Any] = {"kernel": kernel, "bias": bias}
    if layer.lora_enabled:
        found["lora_kernel_a"], found["lora_kernel_b"] = ghost.lora_products(
            kernel,
            ops.convert_to_tensor(layer.lora_kernel_a),
            ops.convert_to_tensor(layer.lora_kernel_b),
            layer.lora_alpha / layer.lora_rank,
        )
    return found


def _dense(inputs: Any, gradient: Any) -> tuple[Any, Any]:
    """A Dense kernel's and bias's terms (positions: the middle axes)."""
    letters = ghost.letters(len(inputs.shape))
    free, c, o = letters[:-2], letters[-2], letters[-1]
    return (
        ghost.Product(inputs, gradient, free + c, free + o, c + o),
        ghost.Product(None, gradient, "", free + o, o),
    )


def _einsum_dense(layer: Any, inputs: Any, gradient: Any) -> tuple[Any, Any]:
    """An EinsumDense kernel's and bias's terms, from its equation."""
    inputs_spec, rest = layer.equation.split(",")
    kernel_spec, outputs_spec = rest.split("->")
    named = sorted(set(inputs_spec + kernel_spec + outputs_spec) - {"."})
    elided = len(inputs.shape) - len(inputs_spec.replace("...", ""))
    letters = ghost.letters(len(named) + elided)
    renamed = dict(zip(named, letters))
    dots = letters[len(named) :]

    def spec(text: str) -> str:
        text = text.replace("...", "0")
        return "".join(dots if c == "0" else renamed[c] for c in text)

    xs, ks, gs = spec(inputs_spec), spec(kernel_spec), spec(outputs_spec)
    kernel = ghost.Product(inputs, gradient, xs[1:], gs[1:], ks)
    bias = None
    if layer.bias is not None:
        aligned = gs[len(gs) - len(layer.bias.shape) :]
        kept = "".join(
            c for c, size in zip(aligned, layer.bias.shape) if size != 1
        )
        bias = ghost.Product(None, gradient, "", gs[1:], kept)
    return kernel, bias


def _convolution(layer: Any, inputs: Any, gradient: Any) -> tuple[Any, Any]:
    """A convolution's kernel and bias terms: patches times gradients."""
    if layer.data_format == "channels_first":
        inputs = ops.moveaxis(inputs, 1, -1)
        gradient = ops.moveaxis(gradient, 1, -1)
    patches = ghost.conv_patches(
        inputs,
        layer.kernel_size,
        layer.strides,
        layer.padding,
        layer.dilation_rate,
    )
    rank = len(layer.kernel_size)
    letters = ghost.letters(2 * rank + 2)
    out, window = letters[:rank], letters[rank : 2 * rank]
    c, f = letters[-2], letters[-1]
    return (
        ghost.Product(
            patches, gradient, out + window + c, out + f, window + c + f
        ),
        ghost.Product(None, gradient, "", out + f, f),
    )


def _table_terms(layer: Any, inputs: Any, gradient: Any) -> dict[str, Any]:
    """The terms of an Embedding call (and of its LoRA weights)."""
    indices = ops.cast(inputs, "int32")
    found: dict[str, Any] = {
        "embeddings": ghost.Rows(indices, gradient, layer.input_dim)
    }
    if layer.lora_enabled:
        scale = layer.lora_alpha / layer.lora_rank
        a = ops.cast(ops.convert_to_tensor(layer.lora_embeddings_a), "float32")
        b = ops.cast(ops.convert_to_tensor(layer.lora_embeddings_b), "float32")
        g = ops.cast(gradient, "float32")
        found["lora_embeddings_a"] = ghost.Rows(
            indices, scale * ops.matmul(g, ops.transpose(b)), layer.input_dim
        )
        letters = ghost.letters(len(gradient.shape))
        free, r, q = letters[:-2], letters[-2], letters[-1]
        found["lora_embeddings_b"] = ghost.Product(
            scale * ops.take(a, indices, axis=0), g, free + r, free + q, r + q
        )
    return found
