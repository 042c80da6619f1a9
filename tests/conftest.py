"""Test session set-up per Keras backend: two devices, markers, quiet logs.

The suite runs once per backend (`KERAS_BACKEND=tensorflow`, `jax`, then
`torch`; see `.ci/run`). Tests about one backend only are marked
`tensorflow`, `jax` or `torch` and skipped on the others. Tests of code
that runs no backend operation (accounting, the audit's statistics, the
sampler's draws: NumPy and dp-accounting) are marked `backend_independent`
and run once, in the pass of the default backend (TensorFlow).
"""

import gc
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
BACKEND = os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# XLA compiles without LLVM's optimizations (TensorFlow's `jit_compile`
# and JAX, here and in the programs tests start): the suite's steps are
# tiny, so compiling them costs more than running them. Measured on
# clipping_mixin_test.py and pcgrad_test.py: JAX 92 s to 72 s,
# TensorFlow 142 s to 123 s.
if BACKEND in ("tensorflow", "jax"):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_backend_optimization_level=0"
    ).strip()

if BACKEND == "torch":
    # Two OpenMP threads on a shared 2-core machine made a step 10x slower.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
elif BACKEND == "jax":
    # DataParallel tests need two devices; JAX reads this at start-up.
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_force_host_platform_device_count=2"
    ).strip()
    # Many tests compile the same small steps: JAX's persistent compilation
    # cache, in a directory of this run only (made by the first pytest
    # process, inherited by its xdist workers and by the programs tests
    # start, removed at the end), compiles each once per run. Measured on
    # tests/guarded_accumulation_test.py: 143 s of CPU without, 92 s with.
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        _JAX_CACHE = tempfile.mkdtemp(prefix="custom_fit_jax_cache_")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
else:
    # oneDNN's custom CPU kernels abort the process (SIGSEGV or SIGABRT) in
    # the per-example gradients of an Embedding or LoRA model
    # (`tf.vectorized_map`; tests/ghost_test.py, sequence and LoRA) on this
    # machine's CPUs (AVX-512 and AMX), with TensorFlow 2.21.0; without
    # them the same tests pass. See BUILD_NOTES, "Known limits".
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    import tensorflow as tf

    # MirroredStrategy tests need two devices; they must exist before
    # TensorFlow initialises its runtime, so this runs at collection time.
    _cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        _cpus[0],
        [tf.config.LogicalDeviceConfiguration()] * 2,
    )
    tf.config.experimental.enable_tensor_float_32_execution(False)

_BACKEND_MARKERS = ("tensorflow", "jax", "torch")
# The pass that runs the `backend_independent` tests.
_INDEPENDENT_PASS = "tensorflow"


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds")
    for name in _BACKEND_MARKERS:
        config.addinivalue_line(
            "markers", f"{name}: runs only with KERAS_BACKEND={name}"
        )
    config.addinivalue_line(
        "markers",
        "backend_independent: runs no backend operation; runs once, with "
        f"KERAS_BACKEND={_INDEPENDENT_PASS}",
    )


def pytest_unconfigure(config):
    del config
    cache = globals().get("_JAX_CACHE")
    if cache is not None:  # only in the process that made it
        shutil.rmtree(cache, ignore_errors=True)


# The modules whose tests take a minute or more (programs of several
# processes, Ray clusters, the benchmark's processes, keras-hub models; the
# durations CI prints), run first: pytest-xdist's `worksteal` gives each
# worker a contiguous share and lets an idle one take from the end of
# another's, so long tests at the front end the pass together, where one
# collected last (Ray's restart, 150 s) ran alone while the other worker
# waited. Not `torch_processes_test.py`: its class runs both processes
# once in `setUpClass`, and at the front a steal split the class over the
# workers, running it three times (PyTorch's pass: 643 s against 575).
_SLOW_FIRST = (
    "ray_train_test.py",
    "multi_worker_test.py",
    "jax_multi_process_test.py",
    "recovery_test.py",
    "benchmarks_test.py",
    "serialization_test.py",
    "keras_hub_test.py",
    "torch_compile_test.py",
    "model_parallel_test.py",
)


def pytest_collection_modifyitems(config, items):
    del config
    # Stable: the order within each group is pytest's.
    items.sort(key=lambda item: item.path.name not in _SLOW_FIRST)
    for item in items:
        for name in _BACKEND_MARKERS:
            if name != BACKEND and item.get_closest_marker(name):
                item.add_marker(
                    pytest.mark.skip(reason=f"needs KERAS_BACKEND={name}")
                )
        if BACKEND != _INDEPENDENT_PASS and item.get_closest_marker(
            "backend_independent"
        ):
            item.add_marker(
                pytest.mark.skip(
                    reason="runs no backend operation: run once, with "
                    f"KERAS_BACKEND={_INDEPENDENT_PASS}"
                )
            )



# Keras' `clear_session` (each test's setUp) runs a full `gc.collect()`,
# which walks every object the process holds: TensorFlow, JAX or PyTorch
# and everything earlier tests left cached, hundreds of thousands of
# objects. Measured on tests/clipping_mixin_test.py (TensorFlow, one
# process): 57 s of its 107 s were those collections. So what is alive
# once the test modules are imported, and again after each test (its
# session cleared, its garbage collected), is frozen (`gc.freeze()`: kept
# out of later collections, never freed by them); each collection then
# walks only what the current test made. That file then ran in 48 s, its
# collections taking 0.8 s.
def pytest_collection_finish(session):
    del session
    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the test's own teardown: clears its session, freezes the rest."""
    del item, nextitem
    import keras

    keras.backend.clear_session()
    gc.collect()  # the test's garbage: walks only what the test made
    gc.freeze()
