"""Which of a model's logs go where during `fit`.

Two callbacks that `fit` adds to the user's (see `KerasModel.fit`):

- `EpochLogs`, first in the list, leaves the figures of one step (reported
  with the `"step"` reduction, such as `grad_norm_step`) out of the epoch's
  logs, so that neither History nor any callback takes the last batch's
  value for an epoch figure;
- `ProgressBar`, Keras' `ProgbarLogger` showing only the logs the model's
  `progress_bar_logs` selects (by default all but the per-layer figures,
  `grad_norm/<layer>`, which a deep model would turn into dozens of
  columns); every callback and History still receive them all.
"""

import difflib
import fnmatch
import warnings
from collections.abc import Callable
from typing import Any

import keras

from custom_fit._types import Logs

# `progress_bar_logs`: every log, or the default selection.
ALL = "all"


class EpochLogs(keras.callbacks.Callback):
    """Removes the figures of one step from the epoch's logs.

    Args:
        step_only: Callable of no arguments returning the set of log keys
            to remove (found when the epoch ends: reported metrics are made
            at the first step).
    """

    def __init__(self, step_only: Callable[[], set[str]]) -> None:
        super().__init__()
        self._step_only = step_only

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Removes them; the later callbacks get the same dict."""
        if logs is None:
            return
        for key in self._step_only():
            logs.pop(key, None)


class ProgressBar(keras.callbacks.ProgbarLogger):
    """Keras' progress bar, showing the selected logs only.

    Args:
        selection: `None` (every log but the per-layer ones, whose keys
            hold a `/`), `"all"`, or a tuple of log names and `fnmatch`
            patterns (`"grad_norm*"`); a selected name shows its `val_`
            twin too.
    """

    def __init__(self, selection: Any) -> None:
        super().__init__()
        self._selection = selection
        self._seen: set[str] = set()
        self._checked = False

    def _shown(self, logs: Logs | None) -> Logs | None:
        """Returns the logs the bar shows."""
        if logs is None or self._selection == ALL:
            return logs
        self._seen.update(logs)
        return {k: v for k, v in logs.items() if selected(k, self._selection)}

    def _check_selection(self) -> None:
        """Warns once for names of the selection that match no log."""
        if self._checked or self._selection in (None, ALL):
            return
        self._checked = True
        for pattern in self._selection:
            if any(selected(key, (pattern,)) for key in self._seen):
                continue
            close = difflib.get_close_matches(pattern, sorted(self._seen), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            warnings.warn(
                f"progress_bar_logs names {pattern!r}, which matches no log "
                f"of this fit: the logs are {sorted(self._seen)}.{hint}",
                UserWarning,
                stacklevel=2,
            )

    def on_train_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Shows the selected logs of the batch."""
        super().on_train_batch_end(batch, self._shown(logs))

    def on_test_batch_end(self, batch: int, logs: Logs | None = None) -> None:
        """Shows the selected logs of the batch."""
        super().on_test_batch_end(batch, self._shown(logs))

    def on_epoch_end(self, epoch: int, logs: Logs | None = None) -> None:
        """Shows the selected logs of the epoch."""
        shown = self._shown(logs)
        self._check_selection()
        super().on_epoch_end(epoch, shown)

    def on_test_end(self, logs: Logs | None = None) -> None:
        """Shows the selected logs of the evaluation."""
        super().on_test_end(self._shown(logs))


def selected(key: str, selection: Any) -> bool:
    """Returns whether the progress bar shows log `key` (see `ProgressBar`)."""
    if selection is None:
        return "/" not in key
    if selection == ALL:
        return True
    name = key[len("val_") :] if key.startswith("val_") else key
    return any(
        fnmatch.fnmatchcase(key, pattern) or fnmatch.fnmatchcase(name, pattern)
        for pattern in selection
    )
