"""Data-parallel training on PyTorch: several processes, true gradients.

Launched the PyTorch way, one process per device (two CPU processes here):

    KERAS_BACKEND=torch torchrun --nproc_per_node=2 \
        examples/torch_data_parallel.py

Each process joins a gloo process group (NCCL on CUDA), reads its share
of every shuffled global batch through a `DataLoader` with a
`DistributedSampler`, and fits the MLP on scikit-learn's digits with
clipping of the global gradient norm and per-layer inspection. custom_fit
sums the processes' gradients (weighted by their batch sizes) before any
mixin sees them, so clipping, inspection and the logs are those of the
global batch, and every process holds the same model after every step.
Started without `torchrun`, the script trains in one process on the same
global batches (the reference):

    KERAS_BACKEND=torch python examples/torch_data_parallel.py

Only process 0 prints and writes files.
"""

import datetime
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

_EPOCHS = flags.DEFINE_integer("epochs", 3, "Training epochs.")
_GLOBAL_BATCH = flags.DEFINE_integer("global_batch_size", 64, "Global batch.")
_OUTPUT_DIR = flags.DEFINE_string(
    "output_dir", "", "If set, process 0 saves the weights here (.npz)."
)


def loader(x, y, batch_size, processes, rank):
    """A `DataLoader` of this process' share of each shuffled global batch.

    The sampler draws one permutation per epoch (from its seed and the
    epoch, which custom_fit's `fit` sets) and gives process `rank` every
    `processes`-th index of it: together the processes' batches `i` are
    the global batch `i` of one process with `processes=1`.
    """
    import torch

    dataset = torch.utils.data.TensorDataset(
        torch.from_numpy(x), torch.from_numpy(y)
    )
    sampler = torch.utils.data.DistributedSampler(
        dataset, num_replicas=processes, rank=rank, shuffle=True, seed=0
    )
    return torch.utils.data.DataLoader(
        dataset, batch_size=batch_size, sampler=sampler
    )


def main(argv):
    """Trains in each process torchrun started, or in this one alone."""
    del argv
    import digits  # examples/digits.py
    import keras
    import mlp  # examples/mlp.py
    import numpy as np
    import torch

    import custom_fit

    class Net(
        custom_fit.GradientClippingMixin,
        custom_fit.GradientInspectionMixin,
        keras.Model,
    ):
        """The MLP with global-norm clipping and inspection."""

    processes, rank = 1, 0
    if "RANK" in os.environ:  # started by torchrun
        torch.distributed.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            timeout=datetime.timedelta(seconds=120),
        )
        processes = torch.distributed.get_world_size()
        rank = torch.distributed.get_rank()
    keras.utils.set_random_seed(rank)  # custom_fit starts all from process 0
    (x_train, y_train), (x_val, y_val) = digits.load_digits(0)
    rows = len(x_train) // _GLOBAL_BATCH.value * _GLOBAL_BATCH.value
    train = loader(
        x_train[:rows],
        y_train[:rows],
        _GLOBAL_BATCH.value // processes,
        processes,
        rank,
    )
    model = mlp.build(Net, x_train.shape[1], global_clipnorm=0.5)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        train,
        epochs=_EPOCHS.value,
        shuffle=False,  # the sampler shuffles
        verbose=2 if rank == 0 else 0,
    )
    # Each process evaluates its share; the logs are the whole set's.
    _, accuracy = model.evaluate(
        x_val[rank::processes], y_val[rank::processes], verbose=0
    )
    if rank == 0:
        print(f"processes: {processes}")
        print(f"validation accuracy: {accuracy:.4f}")
        print(f"clip rate per epoch: {history.history['clip_rate']}")
        if _OUTPUT_DIR.value:
            os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
            np.savez(
                os.path.join(_OUTPUT_DIR.value, f"processes_{processes}.npz"),
                *model.get_weights(),
                sampler_epoch=train.sampler.epoch,
                accuracy=accuracy,
                loss=history.history["loss"],
            )
    if processes > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    app.run(main)
