"""Where a custom_fit model meets `keras.Model`: its public surface.

`TrainStepMixin` inherits this class first. It holds what a Keras user
calls on any model and what Keras' own loop and saving call: the `layers`
and `jit_compile` properties, `compile_from_config`, `metrics` and
`get_metrics_result` (with the figures of `report_metric`), `fit` (a new
count of consecutive skipped steps per call), the train and test functions
(`custom_fit._step_functions`), and `get_config`/`from_config` (the mixin
keywords). The step itself, its hooks and `minimize` are in
`train_step_mixin.py`.
"""

import contextlib
import inspect
import threading
import warnings
from collections.abc import Callable
from collections.abc import Iterator
from typing import Any
from typing import TypeVar

import keras

from custom_fit import _fit_data
from custom_fit import _fit_logs
from custom_fit import _keras_compat
from custom_fit import _model_state
from custom_fit import _options
from custom_fit import _slots
from custom_fit import _step_checks
from custom_fit import _step_functions
from custom_fit import _step_metrics
from custom_fit import backend
from custom_fit._types import Logs
from custom_fit._types import ModelBase
from custom_fit._types import StepFunction

_Model = TypeVar("_Model", bound="KerasModel")


class KerasModel(ModelBase):
    """The `keras.Model` methods a custom_fit model overrides.

    A base of `TrainStepMixin` (not for direct use): every method defers to
    Keras (`super()`) and adds what custom_fit needs.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Leaves `layers` a plain attribute where Keras has no property.

        A custom_fit trainer mixed into a `keras.layers.Layer` (as Keras'
        own `Trainer` can be) may keep its sublayers in `self.layers`, as
        on any layer: only a `keras.Model` reserves that name.
        """
        super().__init_subclass__(**kwargs)
        if _keras_property_or_none(cls, "layers") is None and any(
            issubclass(klass, keras.layers.Layer) for klass in cls.__mro__
        ):
            cls.layers = _LayerAttribute()  # type: ignore[assignment]

    @property
    def layers(self) -> list[keras.layers.Layer]:
        """The model's layers, as in Keras.

        `keras.models.clone_model` of a Sequential subclass is refused
        here: Keras would return a plain `keras.Sequential`.
        """
        _keras_compat.refuse_sequential_clone(self)
        return super().layers

    @layers.setter
    def layers(self, value: Any) -> None:
        # Keras' own setter refuses the name, with its own message.
        keras_property = _keras_property(self, "layers")
        if keras_property.fset is None:
            raise AttributeError("`layers` is reserved. Use another name.")
        keras_property.fset(self, value)

    @property
    def jit_compile(self) -> Any:
        """Whether the step is compiled, as in Keras (set by `compile`)."""
        return _keras_property(self, "jit_compile").__get__(self)

    @jit_compile.setter
    def jit_compile(self, value: Any) -> None:
        # A setting the backend's step cannot run (none today: see
        # `check_compile`) is refused, and the model keeps its setting.
        keras_property = _keras_property(self, "jit_compile")
        previous = keras_property.__get__(self)
        keras_property.__set__(self, value)
        try:
            backend.current().check_compile(self.jit_compile)
        except ValueError:
            keras_property.__set__(self, previous)
            raise

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Configures the model for training: `keras.Model.compile`.

        Takes Keras' arguments. A setting custom_fit cannot run is refused
        before anything changes, so that a refused `compile` leaves the
        model as it was (its optimizer, loss and `jit_compile`): a
        `jit_compile` the backend's step cannot run, and an optimizer that
        accumulates gradients itself.

        Args:
            *args: The positional arguments of `keras.Model.compile`.
            **kwargs: Its keyword arguments.
        """
        _options.refuse_options_in_call(type(self), "compile", kwargs)
        # By name: a model's own `compile` (a keras-hub task's) may take
        # other arguments than Keras'; the optimizer comes first in all.
        jit_compile = kwargs.get("jit_compile", "auto")
        if jit_compile != "auto" and not kwargs.get("run_eagerly"):
            backend.current().check_compile(jit_compile)
        optimizer = args[0] if args else kwargs.get("optimizer")
        if not isinstance(optimizer, (str, type(None))):
            _step_checks.refuse_accumulating_optimizer(optimizer)
        super().compile(*args, **kwargs)

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """Compiles a loaded model from its saved compile configuration.

        As in Keras, except for one setting. The configuration holds
        `jit_compile` as the saving backend resolved it: `"auto"` becomes
        `True` on JAX and TensorFlow. Where this backend refuses that value
        (none does today; PyTorch compiles the forward pass), the model is
        compiled with `"auto"` instead, with a warning.

        Args:
            config: The dict that `get_compile_config()` returned.
        """
        if type(self).compile is not KerasModel.compile:
            # The user's own `compile`: Keras says it cannot call it.
            super().compile_from_config(config)
            return
        jit_compile = config.get("jit_compile")
        try:
            backend.current().check_compile(jit_compile)
        except ValueError as error:
            warnings.warn(
                f"The saved compile configuration has "
                f"jit_compile={jit_compile!r}, as the backend it was saved "
                f"under resolved it; compiling with jit_compile='auto'. "
                f"{error}",
                stacklevel=2,
            )
            config = {**config, "jit_compile": "auto"}
        # What Keras' own `compile_from_config` does, which skips a model
        # whose class overrides `compile` (this one does, above).
        self.compile(**keras.saving.deserialize_keras_object(config))
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)

    @property
    def metrics(self) -> list[keras.metrics.Metric]:
        """The model's metrics, then those of `report_metric`.

        Those of `report_metric` include the ones reported by custom_fit
        networks inside this model (see `minimize`).
        """
        return self._keras_metrics() + _step_metrics.reported(
            self._registries()
        )

    def _configure_if_needed(self) -> None:
        """Configures the options where `__init__` did not (the mixin's)."""

    def _check_before_fit(self) -> None:
        """Checks, before `fit`'s first step, what the model is now.

        Called by `fit` on the model and each custom_fit network in it, so
        that a setting the model's present state refuses (a layer frozen
        since it was made) stops `fit` before any network is updated. A
        mixin extends it.
        """

    def _keras_metrics(self) -> list[keras.metrics.Metric]:
        """Keras' own metrics of the model, without those of `report_metric`."""
        return super().metrics

    def get_metrics_result(self) -> Logs:
        """Returns the metric results, as Keras' `get_metrics_result`.

        Inside a train (test) step, metrics of `report_metric` that only the
        test (train) step reports are left out, so that training logs carry
        no `val_` figure and the other way round. So is Keras' `loss` when
        the model was compiled without a loss and the step does not track
        one (a GAN whose `train_step` reports its own losses).

        Returns:
            A dict of metric name to result.

        Raises:
            ValueError: If a reported metric has the name of one of the
                metrics Keras logs (it would replace it).
        """
        if getattr(_LOGS_DEFERRED, "model", None) is self:
            return {}
        keras_metrics = self._keras_metrics()
        registries = self._registries()
        for registry in registries:
            registry.flush()  # the step's collected reports
        # Over several processes (PyTorch), the logs of the global batch.
        return backend.current().summed_results(
            keras_metrics + _step_metrics.reported(registries),
            lambda: _step_metrics.step_logs(
                self,
                keras_metrics,
                registries,
                tracks_loss=getattr(self, "loss", None) is not None,
            ),
        )

    @contextlib.contextmanager
    def _logs_deferred(self) -> Iterator[None]:
        """Makes `get_metrics_result` return `{}` inside the block.

        A guarded step takes its logs after the verdict; those Keras'
        `compute_metrics` returns before it would be computed for nothing
        (on an eager backend, every metric's result, at every step).
        """
        outer = getattr(_LOGS_DEFERRED, "model", None)
        _LOGS_DEFERRED.model = self
        try:
            yield
        finally:
            _LOGS_DEFERRED.model = outer

    def _registries(self) -> list[_step_metrics.StepMetrics]:
        """The `report_metric` registries of this model and its networks."""
        return [
            _model_state.state_of(model).metrics
            for model in _model_state.models_in(self)
        ]

    def fit(self, *args: Any, **kwargs: Any) -> Any:
        """Trains the model: `keras.Model.fit`, with the same arguments.

        Each call starts a new count of consecutive skipped steps for
        `max_consecutive_skipped_steps`: a `fit` stopped by the limit does
        not stop the next one. The epoch's logs (History, callbacks) leave
        out the figures of one step (`grad_norm_step`), and the progress
        bar shows the logs `progress_bar_logs` selects. On PyTorch, a
        `DataLoader` whose sampler has `set_epoch` (a
        `DistributedSampler`) is told each epoch's index before the epoch.
        Over several processes (PyTorch's, JAX's under a
        `keras.distribution`, TensorFlow's workers) files are written once:
        Keras' writing callbacks (`ModelCheckpoint`, `CSVLogger`,
        `TensorBoard`) and those whose `writes_files` says so write the
        user's paths from the first process only (every process holds the
        same model and logs), and `BackupAndRestore` restores in every
        process.

        Where several processes each feed their share of every global batch
        (`torch.distributed`, or JAX under a `keras.distribution`), they
        compare their batch counts before the first step. A
        `custom_fit.sampling.PoissonSampler` is fed in its order unless
        `shuffle=True` is given in one process: its batches are independent
        draws, so their order changes nothing, and one process then trains
        on the batches several processes train on; over several processes
        shuffling would pair shares of different draws, and is refused.
        Where Keras deals a `PyDataset`'s batches to the processes itself
        (Keras 3.16, `auto_shard_dataset` on), a number of batches the
        processes do not divide and a short last batch are refused (a
        process left waiting, a global batch of unequal shares), and so is
        a sampler.

        Returns:
            A `History` object, as `keras.Model.fit` returns.

        Raises:
            ValueError: Over several processes, for unequal batch counts,
                samplers that differ, `shuffle=True` with a sampler, or a
                `PyDataset` that Keras' sharding would feed unevenly.
        """
        self._configure_if_needed()
        for model in _model_state.models_in(self):
            model._check_before_fit()
        for model in _model_state.models_in(self):
            _model_state.state_of(model).guard.restart()
        _step_functions.forget_last_call(self)
        arguments = fit_arguments(self, args, kwargs)
        x: Any = arguments.get("x")
        shuffled = _fit_data.is_sampler(x) and bool(arguments.get("shuffle"))
        _fit_data.check_processes_agree(
            _fit_data.fit_batches(arguments), x, shuffled
        )
        for model in _model_state.models_in(self):
            _options.agree_on_secret_seeds(model)
        _fit_data.check_keras_shards(
            x, arguments.get("steps_per_epoch"), "training"
        )
        _fit_data.check_keras_shards(
            arguments.get("validation_data"),
            arguments.get("validation_steps"),
            "validation",
        )
        if _fit_data.is_sampler(x):
            backend.current().check_sampler(self, x)
            # Its batches are independent draws: in order by default, so
            # one process trains on the batches several processes do.
            arguments.setdefault("shuffle", False)
            x.use_share(*backend.current().data_shards())
        callbacks = arguments.get("callbacks")
        if not isinstance(callbacks, keras.callbacks.CallbackList):
            arguments["callbacks"] = self._fit_callbacks(
                backend.current().fit_callbacks(
                    self,
                    list(keras.tree.flatten(callbacks or [])),
                    arguments.get("x"),
                ),
                arguments.get("verbose", "auto"),
            )
        history = super().fit(**arguments)
        # The streak of skipped steps of the last call, read one call late.
        _step_functions.check_last_call(self)
        return history

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """Evaluates the model: `keras.Model.evaluate`, same arguments.

        Over several processes, each evaluating its share
        (`torch.distributed`, or JAX under a `keras.distribution`), the
        processes' batch counts are compared first (unequal ones are
        refused: the metrics are summed over the processes at every batch).

        Returns:
            What `keras.Model.evaluate` returns.
        """
        _options.refuse_options_in_call(type(self), "evaluate", kwargs)
        if backend.current().data_shards()[0] > 1:
            arguments = KERAS_EVALUATE.bind(self, *args, **kwargs).arguments
            _fit_data.check_processes_agree(
                {
                    "evaluation": _fit_data.batches_per_epoch(
                        arguments.get("x"),
                        arguments.get("batch_size"),
                        arguments.get("steps"),
                    )
                },
                arguments.get("x"),
            )
            _fit_data.check_keras_shards(
                arguments.get("x"), arguments.get("steps"), "evaluation"
            )
        return super().evaluate(*args, **kwargs)

    def _fit_callbacks(
        self, callbacks: list[Any], verbose: Any
    ) -> list[keras.callbacks.Callback]:
        """Returns `callbacks` with those that route the logs."""
        routed = [
            _fit_logs.EpochLogs(
                lambda: _step_metrics.step_only(self._registries())
            ),
            *callbacks,
        ]
        has_bar = any(
            isinstance(c, keras.callbacks.ProgbarLogger) for c in callbacks
        )
        if verbose != 0 and not has_bar:
            routed.append(
                _fit_logs.ProgressBar(getattr(self, "progress_bar_logs", None))
            )
        return routed

    def make_train_function(self, force: bool = False) -> StepFunction:
        """Builds the train function (see `custom_fit._step_functions`).

        Args:
            force: Bool. Rebuild even if a train function exists.

        Returns:
            The train function.
        """
        return self._step_function("train", force)

    def make_test_function(self, force: bool = False) -> StepFunction:
        """Builds the test function, as `make_train_function` the train one."""
        return self._step_function("test", force)

    def _step_function(self, kind: str, force: bool) -> StepFunction:
        """Builds (unless one exists) and returns the `kind` function."""
        self._configure_if_needed()
        attribute = f"{kind}_function"
        if getattr(self, attribute, None) is None or force:
            setattr(
                self,
                attribute,
                _step_functions.make(
                    self, kind, lambda: self._keras_function(kind, force)
                ),
            )
        return getattr(self, attribute)

    def _keras_function(self, kind: str, force: bool) -> StepFunction:
        """Returns Keras' own train (or test) function, built by Keras."""
        trainer: Any = super()
        if kind == "train":
            trainer.make_train_function(force=force)
            return self.train_function
        trainer.make_test_function(force=force)
        return self.test_function

    # Serialization.

    def save_own_variables(self, store: Any) -> None:
        """Saves the model's variables and its `Slots(saved=True)`."""
        super().save_own_variables(store)
        _slots.save(self, store)

    def load_own_variables(self, store: Any) -> None:
        """Loads what `save_own_variables` saved."""
        super().load_own_variables(_slots.load(self, store))

    def get_config(self) -> dict[str, Any]:
        """Returns the model config plus every mixin keyword.

        Returns:
            A dict: the Keras model config, updated with one entry per mixin
            keyword (the constructor argument names), except the secret ones
            (`Option(saved=False)`, such as `noise_seed`).
        """
        config = super().get_config()
        config.update(
            {
                name: _options.to_config(getattr(self, name))
                for name in _options.saved_options(type(self))
            }
        )
        return config

    @classmethod
    def from_config(
        cls: type[_Model],
        config: dict[str, Any],
        custom_objects: dict[str, Any] | None = None,
    ) -> _Model:
        """Rebuilds a model from `get_config()`, mixin keywords included.

        Keras' `Sequential.from_config` drops unknown keys, so the mixin
        keywords are taken out and handed to the constructor that Keras'
        `from_config` calls. `custom_objects` goes to that `from_config`
        when it takes the argument (Keras' models do); for one that does
        not (a keras-hub `Task`), they are in scope while it runs.

        Args:
            config: Dict returned by `get_config()`.
            custom_objects: Optional dict of custom objects.

        Returns:
            The model.
        """
        config = dict(config)
        options = _options.without_former_defaults(
            cls,
            {
                name: _options.from_config(value)
                for name, value in _options.pop_options(cls, config).items()
            },
        )
        parent_from_config = super().from_config
        with _options.pending(cls, options) as held:
            if custom_objects is None:
                model = parent_from_config(config)
            elif _takes_keyword(parent_from_config, "custom_objects"):
                model = parent_from_config(
                    config, custom_objects=custom_objects
                )
            else:
                with keras.saving.custom_object_scope(custom_objects):
                    model = parent_from_config(config)
        if not held.taken:
            # Keras built the model some other way: apply them afterwards.
            model._configure_options(options)
        return model


# The model whose step defers its logs, per thread (`_logs_deferred`).
_LOGS_DEFERRED = threading.local()

# The signature of Keras' `fit`, `self` included.
KERAS_FIT = inspect.signature(keras.Model.fit)
KERAS_EVALUATE = inspect.signature(keras.Model.evaluate)


def fit_arguments(
    model: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """Returns `fit`'s arguments by name (`self` left out).

    Keras' defaults are not filled in. An option of a mixin among them is
    refused first, naming the fix (Keras' own error names neither).
    """
    _options.refuse_options_in_call(type(model), "fit", kwargs)
    arguments = dict(KERAS_FIT.bind(model, *args, **kwargs).arguments)
    del arguments["self"]
    return arguments


def _keras_property(model: Any, name: str) -> property:
    """Returns Keras' property `name` of the model's class (after ours).

    Raises:
        AttributeError: If no class after `KerasModel` defines one.
    """
    found = _keras_property_or_none(type(model), name)
    if found is None:
        raise AttributeError(f"No Keras property {name!r} on {type(model)}.")
    return found


def _keras_property_or_none(cls: type, name: str) -> property | None:
    """Returns Keras' property `name` of `cls` (after ours), or `None`."""
    mro = cls.__mro__
    for klass in mro[mro.index(KerasModel) + 1 :]:
        found = vars(klass).get(name)
        if isinstance(found, property):
            return found
    return None


class _LayerAttribute:
    """`layers` on a layer that is no `keras.Model`: an ordinary attribute.

    A non-data descriptor: an assignment goes through the layer's own
    `__setattr__` (Keras tracks the sublayers) into the instance, which then
    shadows this; before one, reading it fails as on any layer.
    """

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            return self
        raise AttributeError(
            f"{type(instance).__name__!r} object has no attribute 'layers'"
        )


def _takes_keyword(function: Callable[..., Any], name: str) -> bool:
    """Returns whether `function` accepts the keyword argument `name`."""
    parameters = inspect.signature(function).parameters.values()
    return any(
        p.name == name or p.kind is inspect.Parameter.VAR_KEYWORD
        for p in parameters
    )
