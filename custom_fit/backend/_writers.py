"""Files written once over several processes: Keras' writing callbacks.

Every process of a data-parallel run holds the same model and the same
logs, so one copy of each file is enough, and processes writing one path
at once would corrupt it. The writers are Keras' `ModelCheckpoint`
(`filepath`), `CSVLogger` (`filename`) and `TensorBoard` (`log_dir`), and
any callback whose class names the attribute that holds its path in
`writes_files` (custom_fit's `GradientTensorBoard`: `"log_dir"`). The
adapter of a backend picks one of two ways:

- `everywhere=False`, where saving or reading the model in one process is
  local (PyTorch's processes): the writers run in the first process only.
  There `writes_files = True` is enough.
- `everywhere=True`, where saving or reading the model's state is a
  collective every process must join (JAX's processes: Keras' state sync
  checks the processes agree; TensorFlow's workers: a synchronized
  variable's value is an all-reduce): the writers run in every process,
  and in every process but the first each hook runs with the writer's
  path moved into a scratch directory of that process (removed when the
  process exits). The callback's own path is the user's again between
  hooks.

`BackupAndRestore` restores the user's backup in every process (on PyTorch
the first before the others, which wait for it: Keras may repair a torn
backup from its previous copy; on JAX and TensorFlow loading is itself
collective, so all at once), so that every process resumes at the same
epoch; the
first process alone saves to and deletes the user's directory, and the
processes wait for each other after the restore and at the end of
training, so that none reads a backup the first is writing.
"""

import atexit
import functools
import os
import shutil
import tempfile
import weakref
from collections.abc import Callable
from typing import Any

import keras

# Keras' writers and the attribute that holds where each writes.
_KERAS_WRITERS = (
    (keras.callbacks.ModelCheckpoint, "filepath"),
    (keras.callbacks.CSVLogger, "filename"),
    (keras.callbacks.TensorBoard, "log_dir"),
)


def path_attribute(callback: Any) -> str | bool | None:
    """Returns where `callback` keeps the path it writes.

    Returns:
        The attribute's name for Keras' writers and a callback whose
        `writes_files` is a string; `True` for `writes_files = True` (it
        writes, its path unknown); `None` for a callback that writes
        nothing.
    """
    for kind, attribute in _KERAS_WRITERS:
        if isinstance(callback, kind):
            return attribute
    declared = getattr(callback, "writes_files", None)
    if declared is True or (isinstance(declared, str) and declared):
        return declared
    if declared not in (None, False):
        raise ValueError(
            f"{type(callback).__name__}.writes_files must be the name of the "
            "attribute that holds the path the callback writes (a string), "
            f"True or False. Received: writes_files={declared!r}."
        )
    return None


def written_once(
    callbacks: list[Any],
    first: bool,
    barrier: Callable[[], None],
    everywhere: bool,
) -> list[Any]:
    """Returns the callbacks one process of several runs.

    Args:
        callbacks: The user's callbacks, the same in every process.
        first: Whether this is the first process, the one that writes.
        barrier: Blocks until every process has called it.
        everywhere: Whether every process must run every writer (see the
            module's docstring).

    Returns:
        `callbacks`, each `BackupAndRestore` shared by the processes, and
        in every process but the first the writers left out
        (`everywhere=False`) or writing into a scratch directory.

    Raises:
        ValueError: With `everywhere=True`, for a callback whose
            `writes_files` is `True`: its path must be named to be moved.
    """
    # Every process checks every callback, so that all raise alike (none
    # left waiting in a collective).
    attributes = [path_attribute(c) for c in callbacks]
    for callback, attribute in zip(callbacks, attributes):
        if everywhere and attribute is True:
            raise ValueError(
                f"{type(callback).__name__} says it writes files "
                "(writes_files=True) but not where: over several processes "
                "of this backend every process runs it (its reads of the "
                "model are collective), and the others' writes are moved "
                "to a scratch directory. Received: writes_files=True. Set "
                "writes_files to the name of the attribute that holds its "
                "path, e.g. writes_files = 'log_dir'."
            )
    kept = []
    for callback, attribute in zip(callbacks, attributes):
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            kept.append(_shared_backup(callback, first, barrier, everywhere))
        elif first or attribute is None:
            kept.append(callback)
        elif everywhere and isinstance(attribute, str):
            kept.append(_Elsewhere(callback, attribute, _scratch_of_one()))
    return kept


@functools.cache
def _scratch() -> str:
    """Returns a scratch directory of the process, removed at its exit."""
    directory = tempfile.mkdtemp(prefix="custom_fit_not_first_process_")
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return directory


def _scratch_of_one() -> str:
    """Returns a new directory in the scratch, for one callback's files."""
    return tempfile.mkdtemp(dir=_scratch())


_HOOKS = tuple(
    name for name in dir(keras.callbacks.Callback) if name.startswith("on_")
)


class _Elsewhere(keras.callbacks.Callback):
    """Runs a writer's hooks with its path moved into `directory`.

    The writer keeps its own path between hooks; during each, the
    attribute `attribute` holds `directory/<the path's last part>`.
    """

    def __init__(self, callback: Any, attribute: str, directory: str) -> None:
        super().__init__()
        self.callback = callback
        self.attribute = attribute
        self.directory = directory
        # Its hooks swap an attribute of the user's callback: never run
        # them from Keras' thread pool, beside the other hooks.
        self.async_safe = False

    def _run(self, name: str, *args: Any, **kwargs: Any) -> Any:
        own = getattr(self.callback, self.attribute, None)
        if own is None:
            return getattr(self.callback, name)(*args, **kwargs)
        last = os.path.basename(os.fspath(own).rstrip("/\\")) or "files"
        moved = os.path.join(self.directory, last)
        setattr(self.callback, self.attribute, moved)
        try:
            return getattr(self.callback, name)(*args, **kwargs)
        finally:
            setattr(self.callback, self.attribute, own)

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        self._run("set_model", model)

    def set_params(self, params: Any) -> None:
        super().set_params(params)
        self._run("set_params", params)


def _hook(name: str) -> Callable[..., Any]:
    def hook(self: _Elsewhere, *args: Any, **kwargs: Any) -> Any:
        return self._run(name, *args, **kwargs)

    hook.__name__ = name
    return hook


for _name in _HOOKS:
    setattr(_Elsewhere, _name, _hook(_name))


# Each user backup's saver in this process's scratch (other processes than
# the first): one per backup, so that its batch counters go on from fit to
# fit as those of the user's backup do in the first process, and both save
# at the same batches.
_SAVERS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _shared_backup(
    backup: Any, first: bool, barrier: Callable[[], None], everywhere: bool
) -> "_SharedBackup":
    """`backup` shared by the processes; saves where this process may."""
    if first:
        return _SharedBackup(backup, backup, first, barrier, everywhere)
    if not everywhere:
        return _SharedBackup(backup, None, first, barrier, everywhere)
    if backup not in _SAVERS:
        keywords = {"save_freq": backup.save_freq, "delete_checkpoint": True}
        if hasattr(backup, "double_checkpoint"):
            keywords["double_checkpoint"] = backup.double_checkpoint
        _SAVERS[backup] = keras.callbacks.BackupAndRestore(
            os.path.join(_scratch_of_one(), "backup"), **keywords
        )
    return _SharedBackup(backup, _SAVERS[backup], first, barrier, everywhere)


class _SharedBackup(keras.callbacks.Callback):
    """A `BackupAndRestore` shared by the processes.

    Every process restores `backup`: where loading is local (PyTorch) the
    first before the others (it may repair a torn backup from Keras'
    previous copy), each side waiting for the other; where loading is
    itself collective (JAX, TensorFlow's workers) all at once. `saver`
    (the backup itself in the first process; in the others a backup of
    the same frequency in a scratch directory, or none) saves and, at the
    end, deletes, after which the processes wait for each other again, so
    that no process reads a backup the first is still writing.
    """

    def __init__(
        self,
        backup: Any,
        saver: Any,
        first: bool,
        barrier: Callable[[], None],
        everywhere: bool,
    ) -> None:
        super().__init__()
        self.backup = backup
        self.saver = saver
        self.first = first
        self.barrier = barrier
        self.everywhere = everywhere

    def _both(self) -> list[Any]:
        return [c for c in (self.backup, self.saver) if c is not None]

    def set_model(self, model: Any) -> None:
        super().set_model(model)
        for callback in self._both():
            callback.set_model(model)

    def set_params(self, params: Any) -> None:
        super().set_params(params)
        for callback in self._both():
            callback.set_params(params)

    def on_train_begin(self, logs: Any = None) -> None:
        if self.everywhere:
            # Loading the weights is itself collective here: at once.
            self.backup.on_train_begin(logs)
        else:
            if self.first:
                self.backup.on_train_begin(logs)
            self.barrier()
            if not self.first:
                self.backup.on_train_begin(logs)
        self.barrier()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.saver is not None:
            self.saver.on_epoch_end(epoch, logs)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self.saver is not None:
            self.saver.on_train_batch_end(batch, logs)

    def on_train_end(self, logs: Any = None) -> None:
        if self.saver is not None:
            self.saver.on_train_end(logs)
        self.barrier()
