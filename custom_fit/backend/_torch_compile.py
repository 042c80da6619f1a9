"""`jit_compile=True` on PyTorch: forward pass and update compiled.

The forward pass and the optimizer's update run under `torch.compile`.

Keras' PyTorch trainer compiles its whole train step with `torch.compile`
when `jit_compile=True`. custom_fit's step reads conditions on the host
(the guard's verdict, the spike rule, inspection's schedule) and keeps
Python state between steps; compiled whole, it broke into about 50 graphs
and took 112 s to compile on a small MLP here. What pays is the model's
own compute and the optimizer's: the forward pass (and, through
AOTAutograd, its backward, which `torch.autograd.grad` then runs) and
`optimizer.apply`. So with `jit_compile=True` the train and test functions
run custom_fit's step eagerly around a compiled forward pass (one compiled
function per model and `training` flag) and a compiled update (one per
optimizer); `predict` is Keras' own (its whole step compiled, as for any
Keras model). Measured on the seed MLP (BUILD_NOTES, "PyTorch over
several processes, and `jit_compile=True`").

Two parts run their forward pass eagerly, with one warning per model
that names them: inside `torch.func` transforms (DP-SGD's vectorized
per-example gradients), and where a pass watches tensors inside the model
(`intermediate_gradients`: DP-SGD's ghost clipping records each layer's
inputs; a compiled forward pass hid them, and the clipped sums were wrong,
weights 6e-3 off after 8 steps).
"""

import contextlib
import threading
import types
import warnings
import weakref
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any

import torch

_LOCAL = threading.local()


# Models already warned of an eager part: model -> the parts named.
_WARNED: "weakref.WeakKeyDictionary[Any, set[str]]" = (
    weakref.WeakKeyDictionary()
)


@contextlib.contextmanager
def eager(reason: str) -> Iterator[None]:
    """Runs the forward passes inside the block eagerly, for `reason`."""
    before = getattr(_LOCAL, "eager", None)
    _LOCAL.eager = reason
    try:
        yield
    finally:
        _LOCAL.eager = before


def _eager_reason() -> str | None:
    """Why the forward pass must run eagerly here, or `None`."""
    if getattr(_LOCAL, "eager", None):
        return str(_LOCAL.eager)
    if torch._C._functorch.peek_interpreter_stack():
        return "runs under a torch.func transform (vmap, grad)"
    return None


def _warn_once(model: Any, reason: str) -> None:
    named = _WARNED.setdefault(model, set())
    if reason in named:
        return
    named.add(reason)
    warnings.warn(
        f"jit_compile=True on PyTorch: a forward pass of {model.name!r} "
        f"runs eagerly, because it {reason} (DP-SGD's per-example "
        "clipping does); the rest of the step's forward passes are "
        "compiled.",
        UserWarning,
        stacklevel=4,
    )


def _own_code(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A copy of `function` with a code object of its own.

    Dynamo keeps its compiled graphs per code object, with a limit of
    recompilations (8): one function shared by every model would be
    recompiled for each and, from the ninth, silently run eagerly. A copy
    per model (per optimizer) has a cache of its own.
    """
    code = function.__code__.replace(co_name=name)
    return types.FunctionType(
        code,
        function.__globals__,
        name,
        function.__defaults__,
        function.__closure__,
    )


def _compiled(owner: Any, key: str, make: Callable[[], Any]) -> Any:
    """The compiled function `key` of `owner`, made once.

    Kept in the owner's `__dict__` (not in a module-level table, whose
    entries would keep every model alive): it goes with its owner.
    """
    table = owner.__dict__.setdefault("_custom_fit_compiled", {})
    if key not in table:
        table[key] = torch.compile(make())
    return table[key]


def forward(
    model: Any, call: Callable[..., Any], x: Any, training: bool
) -> Any:
    """Returns `call(model, x, training=training)`, compiled if asked.

    Compiled (`torch.compile`) when the model was compiled with
    `jit_compile=True`, outside the parts named in the module's docstring.
    """
    if model.jit_compile is not True:
        return call(model, x, training=training)
    reason = _eager_reason()
    if reason is not None:
        _warn_once(model, reason)
        return call(model, x, training=training)

    def make() -> Any:
        def forward_pass(inputs: Any) -> Any:
            return call(model, inputs, training=training)

        return _own_code(forward_pass, f"forward_{id(model)}_{training}")

    return _compiled(model, f"forward_{training}", make)(x)


def apply(optimizer: Any, gradients: list[Any], variables: list[Any]) -> None:
    """Runs `optimizer.apply`, compiled in a compiled step.

    Compiled inside a train function of `step_function` (a model with
    `jit_compile=True`).
    """
    if not getattr(_LOCAL, "compiled_step", False):
        optimizer.apply(gradients, variables)
        return

    def make() -> Any:
        def update(gradients: list[Any], variables: list[Any]) -> None:
            optimizer.apply(gradients, variables)

        return _own_code(update, f"apply_{id(optimizer)}")

    _compiled(optimizer, "apply", make)(gradients, variables)


def step_function(model: Any, kind: str) -> Callable[[Any], Any]:
    """The train or test function of a model compiled with `jit_compile`.

    What Keras' PyTorch trainer runs (a step for each batch of the list a
    call is given), without compiling the whole step: `forward` compiles
    the model's part.
    """
    if kind == "train":

        def train_function(data: Any) -> Any:
            _LOCAL.compiled_step = True
            try:
                logs = {}
                for batch in data:
                    logs = model.train_step(batch)
                return logs
            finally:
                _LOCAL.compiled_step = False

        return train_function

    def test_function(data: Any) -> Any:
        logs = {}
        with torch.no_grad():
            for batch in data:
                logs = model.test_step(batch)
        return logs

    return test_function
