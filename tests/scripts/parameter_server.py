"""Builds a mixin model under ParameterServerStrategy (in-process cluster).

Run by tests/recovery_test.py (ParameterServerTest) in a separate
process, because a ParameterServerStrategy turns the process's eager
context into a cluster client. Prints the outcome on the last line.
"""

import os
import socket
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import custom_fit  # noqa: E402


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def main(kind):
    workers, ps = free_ports(2), free_ports(1)
    cluster = tf.train.ClusterSpec(
        {
            "worker": [f"localhost:{p}" for p in workers],
            "ps": [f"localhost:{p}" for p in ps],
        }
    )
    for index in range(2):
        tf.distribute.Server(cluster, job_name="worker", task_index=index)
    tf.distribute.Server(cluster, job_name="ps", task_index=0)
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster, rpc_layer="grpc"
    )
    strategy = tf.distribute.experimental.ParameterServerStrategy(resolver)

    class Net(custom_fit.GradientClippingMixin, keras.Model):
        pass

    model_class = keras.Model if kind == "plain" else Net
    data = tf.data.Dataset.from_tensor_slices(
        (np.ones((32, 3), "float32"), np.ones((32, 1), "float32"))
    )
    try:
        with strategy.scope():
            inputs = keras.Input((3,))
            model = model_class(inputs, keras.layers.Dense(1)(inputs))
            model.compile(optimizer="sgd", loss="mse")
        model.fit(data.batch(8).repeat(), epochs=1, steps_per_epoch=4)
        print("RESULT trained")
    except ValueError as error:
        print("RESULT ValueError", str(error).replace("\n", " "))


if __name__ == "__main__":
    main(sys.argv[1])
