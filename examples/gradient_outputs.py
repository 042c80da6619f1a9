"""What the inspection examples write: TensorBoard logs, a PNG and a CSV.

Shared by `inspect_gradients.py` and `mnist_mlp.py`. Every figure comes
from `custom_fit.GradientInspectionMixin`'s state, recorded inside the
training step; nothing here recomputes a gradient.
"""

import os

import keras

from custom_fit import callbacks


def inspection_callbacks(output_dir, log_every):
    """Returns the callbacks that record and write per-layer gradients.

    Args:
        output_dir: String. TensorBoard logs go to `<output_dir>/logs`.
        log_every: Integer. Write or record every this many steps.

    Returns:
        A tuple `(callback_list, norm_history)`: Keras' `TensorBoard`,
        `GradientTensorBoard` on the same log directory, a
        `GradientNormHistory` (also returned, for `write_norm_history`) and
        a `GradientAlarm` that warns, naming the first bad layer.
    """
    log_dir = os.path.join(output_dir, "logs")
    norm_history = callbacks.GradientNormHistory(every_n_batches=log_every)
    callback_list = [
        keras.callbacks.TensorBoard(log_dir),
        callbacks.GradientTensorBoard(log_dir, update_freq=log_every),
        norm_history,
        callbacks.GradientAlarm(action="warn"),
    ]
    return callback_list, norm_history


def write_norm_history(norm_history, output_dir):
    """Writes the per-layer norms as a PNG (log scale) and a CSV.

    Args:
        norm_history: The `GradientNormHistory` that recorded the run.
        output_dir: String. The directory to write into.

    Returns:
        The paths `(png, csv)`.
    """
    png = os.path.join(output_dir, "gradient_norms.png")
    csv = os.path.join(output_dir, "gradient_norms.csv")
    norm_history.plot(png)
    norm_history.to_csv(csv)
    return png, csv
