"""Per-loss gradients and PCGrad against plain Keras and a NumPy
implementation of the paper's algorithm (Yu et al. 2020)."""

import itertools
import warnings

import keras
import numpy as np
from absl.testing import parameterized
from keras import ops

import custom_fit
from custom_fit import pcgrad
from tests import testing

BATCH = 16
RATE = 0.05
WEIGHTS = {"a": 1.0, "b": 0.5, "c": 2.0}


class Summed(custom_fit.TrainStepMixin, keras.Model):
    pass


class PCGradNet(custom_fit.PCGradMixin, keras.Model):
    pass


class RegularizedPCGradNet(
    custom_fit.PCGradMixin, custom_fit.RegularizationMixin, keras.Model
):
    pass


def losses():
    return {
        "a": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        "b": keras.losses.MeanSquaredError(),
        "c": keras.losses.MeanSquaredError(),
    }


def multi_task_model(
    model_class=keras.Model, tasks=("a", "b", "c"), regularizer=None, **kwargs
):
    """A shared Dense trunk and one head per task, with fixed weights.

    Head `a` classifies (3 logits), heads `b` and `c` regress (1 unit).
    """
    inputs = keras.Input((4,), name="features")
    shared = keras.layers.Dense(
        8,
        activation="tanh",
        kernel_initializer=keras.initializers.GlorotUniform(seed=1),
        bias_initializer=keras.initializers.RandomNormal(0.0, 0.1, seed=1),
        kernel_regularizer=regularizer,
        name="shared",
    )(inputs)
    units = {"a": 3, "b": 1, "c": 1}
    outputs = {
        name: keras.layers.Dense(
            units[name],
            kernel_initializer=keras.initializers.GlorotUniform(seed=2 + i),
            name=name,
        )(shared)
        for i, name in enumerate(tasks)
    }
    return model_class(inputs, outputs, **kwargs)


def multi_task_data(samples=64, tasks=("a", "b", "c")):
    """Targets that pull the shared trunk in opposite directions."""
    x, labels = testing.classification_data(samples=samples)
    total = x.sum(axis=1, keepdims=True)
    y = {"a": labels, "b": total, "c": -total + x[:, :1]}
    return x, {name: y[name] for name in tasks}


def compiled(model, tasks=("a", "b", "c"), optimizer=None, **compile_kwargs):
    model.compile(
        optimizer=optimizer or keras.optimizers.SGD(RATE),
        loss={name: losses()[name] for name in tasks},
        loss_weights={name: WEIGHTS[name] for name in tasks},
        **compile_kwargs,
    )
    return model


def fit(model, x, y, epochs=1, batch_size=BATCH, callbacks=()):
    return model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    ).history


def task_gradients(model, x, y, name):
    """The oracle gradient of one task's weighted loss, zeros where the
    task does not reach (the other heads)."""

    def loss_fn(y_true, y_pred):
        loss = WEIGHTS[name] * losses()[name](y_true[name], y_pred[name])
        for other in y_pred.values():  # zeros instead of no gradient
            loss = loss + 0.0 * ops.sum(other)
        return loss

    return testing.tape_gradients(model, x, y, loss_fn)


def numpy_pcgrad(task_grads, order):
    """PCGrad as the paper writes it: each task's gradient, flattened over
    all variables, is projected against the original gradient of every
    other task, in `order`, that it conflicts with; the results are summed.
    """
    shapes = [np.shape(g) for g in task_grads[0]]
    flat = [
        np.concatenate([np.ravel(g) for g in grads]).astype(np.float64)
        for grads in task_grads
    ]
    total = np.zeros_like(flat[0])
    for i, g_i in enumerate(flat):
        g = g_i.copy()
        for j in order:
            if j == i:
                continue
            dot = g @ flat[j]
            if dot < 0:
                g = g - dot / (flat[j] @ flat[j]) * flat[j]
        total += g
    pieces, start = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        pieces.append(total[start : start + size].reshape(shape))
        start += size
    return pieces


def sgd_step(model, grads):
    """Applies `w - RATE * g` to the model's trainable variables."""
    for variable, g in zip(model.trainable_variables, grads):
        w = testing.to_numpy(variable)
        variable.assign(np.asarray(w - RATE * g, "float32"))


def batches(x, y, batch_size=BATCH):
    for start in range(0, len(x), batch_size):
        yield (
            x[start : start + batch_size],
            {k: v[start : start + batch_size] for k, v in y.items()},
        )


class TaskOrders(keras.callbacks.Callback):
    """Records `model.task_order` after every batch."""

    def __init__(self):
        super().__init__()
        self.orders = []

    def on_train_batch_end(self, batch, logs=None):
        self.orders.append(self.model.task_order)


class DefaultSumTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_outputs_mode_equals_plain_keras(self, mode):
        """per_loss_gradients="outputs" with the sum equals plain Keras."""
        x, y = multi_task_data()
        regularizer = keras.regularizers.L2(0.01)
        model = multi_task_model(
            Summed, regularizer=regularizer, per_loss_gradients="outputs"
        )
        history = fit(compiled(model, **mode), x, y, epochs=2)
        plain = multi_task_model(regularizer=regularizer)
        expected = fit(compiled(plain, **mode), x, y, epochs=2)
        self.assertWeightsClose(model, plain, atol=2e-6)
        self.assertEqual(sorted(history), sorted(expected))
        for key, values in expected.items():
            self.assertAllClose(history[key], values, rtol=1e-5, msg=key)

    def test_outputs_and_penalties_mode_equals_plain_keras(self):
        """ "outputs_and_penalties" with the sum equals plain Keras."""
        x, y = multi_task_data()
        regularizer = keras.regularizers.L2(0.01)
        model = multi_task_model(
            Summed,
            regularizer=regularizer,
            per_loss_gradients="outputs_and_penalties",
        )
        history = fit(compiled(model), x, y, epochs=2)
        plain = multi_task_model(regularizer=regularizer)
        expected = fit(compiled(plain), x, y, epochs=2)
        self.assertWeightsClose(model, plain, atol=2e-6)
        self.assertEqual(sorted(history), sorted(expected))
        for key, values in expected.items():
            self.assertAllClose(history[key], values, rtol=1e-5, msg=key)

    def test_combine_gradients_receives_one_true_gradient_per_loss(self):
        """combine_gradients gets each loss's oracle gradient by name."""
        x, y = multi_task_data(samples=BATCH)
        received = {}

        class FirstTaskOnly(custom_fit.TrainStepMixin, keras.Model):
            def combine_gradients(self, gradients_by_loss, variables):
                received.update(gradients_by_loss)
                return [
                    ops.zeros_like(v) if g is None else g
                    for g, v in zip(gradients_by_loss["a"], variables)
                ]

        model = multi_task_model(FirstTaskOnly, per_loss_gradients="outputs")
        compiled(model, run_eagerly=True)
        oracle = multi_task_model()
        expected = {name: task_gradients(oracle, x, y, name) for name in "abc"}
        fit(model, x, y)
        self.assertEqual(sorted(received), ["a", "b", "c"])
        for name, grads in expected.items():
            got = [
                np.zeros_like(e) if g is None else testing.to_numpy(g)
                for g, e in zip(received[name], grads)
            ]
            self.assertAllClose(got, grads, atol=1e-6, rtol=1e-5, msg=name)
        sgd_step(oracle, expected["a"])
        self.assertWeightsClose(model, oracle, atol=1e-6)


class PCGradTest(testing.TestCase):
    def assertPCGradSteps(
        self, model, x, y, orders, tasks, batch_size=BATCH, atol=2e-6
    ):
        """Replays the steps with the NumPy PCGrad and the given orders."""
        oracle = multi_task_model(tasks=tasks)
        self.assertLen(orders, -(-len(x) // batch_size))
        for (xb, yb), order in zip(batches(x, y, batch_size), orders):
            grads = [task_gradients(oracle, xb, yb, name) for name in tasks]
            sgd_step(oracle, numpy_pcgrad(grads, order))
        self.assertWeightsClose(model, oracle, atol=atol)
        return oracle

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_three_tasks_one_step_equals_numpy_pcgrad(self, mode):
        """One step of three tasks is NumPy PCGrad in model.task_order."""
        x, y = multi_task_data()
        model = compiled(multi_task_model(PCGradNet, pcgrad_seed=1), **mode)
        fit(model, x, y, batch_size=len(x))
        order = model.task_order
        self.assertEqual(sorted(order), [0, 1, 2])
        self.assertPCGradSteps(model, x, y, [order], "abc", len(x))

        # The order matters for these gradients, and PCGrad is not the sum.
        oracle = multi_task_model()
        grads = [task_gradients(oracle, x, y, name) for name in "abc"]
        results = [
            numpy_pcgrad(grads, list(p))
            for p in itertools.permutations(range(3))
        ]
        self.assertGreater(
            max(testing.max_difference(results[0], r) for r in results), 1e-5
        )
        summed = [sum(column) for column in zip(*grads)]
        self.assertGreater(testing.max_difference(results[0], summed), 1e-3)

    @parameterized.named_parameters(
        *testing.runnable(
            [
                ("eager", dict(run_eagerly=True)),
                ("jit", dict(jit_compile=True)),
            ]
        )
    )
    def test_three_tasks_over_several_steps(self, mode):
        """Each step is NumPy PCGrad in the order task_order showed."""
        x, y = multi_task_data()
        model = compiled(multi_task_model(PCGradNet, pcgrad_seed=5), **mode)
        orders = TaskOrders()
        fit(model, x, y, epochs=2, callbacks=[orders])
        self.assertLen(orders.orders, 8)
        self.assertGreater(len({tuple(o) for o in orders.orders}), 1)
        x2 = np.concatenate([x, x])
        y2 = {k: np.concatenate([v, v]) for k, v in y.items()}
        self.assertPCGradSteps(model, x2, y2, orders.orders, "abc")

    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_two_tasks_equal_numpy_pcgrad_in_any_order(self, mode):
        """With two tasks NumPy PCGrad in either order is the update."""
        x, y = multi_task_data(tasks=("b", "c"))
        model = multi_task_model(PCGradNet, tasks=("b", "c"))
        fit(compiled(model, tasks=("b", "c"), **mode), x, y, epochs=2)
        x2 = np.concatenate([x, x])
        y2 = {k: np.concatenate([v, v]) for k, v in y.items()}
        self.assertPCGradSteps(model, x2, y2, [[0, 1]] * 8, "bc")
        self.assertPCGradSteps(model, x2, y2, [[1, 0]] * 8, "bc")
        # The tasks conflict: the plain sum ends elsewhere.
        plain = multi_task_model(tasks=("b", "c"))
        fit(compiled(plain, tasks=("b", "c")), x, y, epochs=2)
        self.assertGreater(
            testing.max_difference(model.get_weights(), plain.get_weights()),
            1e-4,
        )

    def test_two_devices_equal_numpy_pcgrad(self):
        """On two devices (MirroredStrategy over two logical CPUs on
        TensorFlow, DataParallel over two host devices on JAX) each step is
        NumPy PCGrad of the global batch's task gradients in the order
        task_order showed: the projection is of summed, not per-device,
        gradients."""
        x, y = multi_task_data()
        orders = TaskOrders()
        with testing.two_devices():
            model = compiled(multi_task_model(PCGradNet, pcgrad_seed=5))
            fit(model, x, y, epochs=2, callbacks=[orders])
        self.assertGreater(len({tuple(o) for o in orders.orders}), 1)
        x2 = np.concatenate([x, x])
        y2 = {k: np.concatenate([v, v]) for k, v in y.items()}
        self.assertPCGradSteps(model, x2, y2, orders.orders, "abc")

    def test_same_seed_gives_the_same_run(self):
        """The same pcgrad_seed gives the same orders and weights."""
        x, y = multi_task_data()
        runs = []
        for _ in range(2):
            keras.utils.set_random_seed(0)
            model = compiled(multi_task_model(PCGradNet, pcgrad_seed=11))
            orders = TaskOrders()
            fit(model, x, y, epochs=2, callbacks=[orders])
            runs.append((model, orders.orders))
        (first, first_orders), (second, second_orders) = runs
        self.assertEqual(first_orders, second_orders)
        self.assertWeightsClose(first, second, atol=0)


class PenaltiesAsTasksTest(testing.TestCase):
    L2 = 0.2

    def l2_gradient(self, model):
        """The gradient of `L2 * sum(kernel**2)`: zero for biases."""
        return [
            2.0 * self.L2 * testing.to_numpy(v)
            if v.name == "kernel"
            else np.zeros(v.shape, "float32")
            for v in model.trainable_variables
        ]

    def regularized(self, per_loss_gradients):
        """A compiled `RegularizedPCGradNet` on tasks b and c, with an l2
        penalty of `L2` and the given `per_loss_gradients`."""
        return compiled(
            multi_task_model(
                RegularizedPCGradNet,
                tasks=("b", "c"),
                l2=self.L2,
                per_loss_gradients=per_loss_gradients,
            ),
            tasks=("b", "c"),
        )

    def test_penalty_is_its_own_task(self):
        """With outputs_and_penalties the l2 penalty is a projected task."""
        x, y = multi_task_data(tasks=("b", "c"))
        oracle = multi_task_model(tasks=("b", "c"))
        # Task b wants its output three times larger, so larger weights:
        # its gradient conflicts with the penalty's (a negative dot).
        y["b"] = 3.0 * testing.to_numpy(oracle(x)["b"])
        grads = [task_gradients(oracle, x, y, name) for name in "bc"]
        penalty = self.l2_gradient(oracle)

        as_task = self.regularized("outputs_and_penalties")
        fit(as_task, x, y, batch_size=len(x))
        order = as_task.task_order
        self.assertEqual(sorted(order), [0, 1, 2])
        expected = numpy_pcgrad([*grads, penalty], order)
        sgd_step(oracle, expected)
        self.assertWeightsClose(as_task, oracle, atol=2e-6)

        apart = self.regularized("outputs")
        history = fit(apart, x, y, batch_size=len(x))
        self.assertEqual(sorted(apart.task_order), [0, 1])
        unprojected = [
            p + q for p, q in zip(numpy_pcgrad(grads, [0, 1]), penalty)
        ]
        reference = multi_task_model(tasks=("b", "c"))
        sgd_step(reference, unprojected)
        self.assertWeightsClose(apart, reference, atol=2e-6)
        self.assertIn("l2_penalty", history)
        # The penalty conflicts with a task here: the two modes differ.
        self.assertGreater(testing.max_difference(expected, unprojected), 1e-4)


def project(task_gradients, order):
    result = pcgrad.project_conflicting(task_gradients, order)
    return [None if g is None else testing.to_numpy(g) for g in result]


def arrays(*values):
    return [np.array(v, "float32") for v in values]


class ProjectConflictingTest(testing.TestCase):
    def test_conflicting_pair(self):
        """A conflicting pair, computed by hand."""
        # a.b = -1: a -> a + b/2 = (0.5, 0.5), b -> b + a = (0, 1); the sum
        # is (0.5, 1.5) in either order.
        a, b = arrays([1.0, 0.0]), arrays([-1.0, 1.0])
        for order in ([0, 1], [1, 0]):
            self.assertAllClose(project([a, b], order), arrays([0.5, 1.5]))

    def test_non_conflicting_pair_is_the_sum(self):
        """a=(1,0), b=(1,1): a.b=1 > 0, nothing is projected."""
        a, b = arrays([1.0, 0.0]), arrays([1.0, 1.0])
        self.assertAllClose(project([a, b], [0, 1]), arrays([2.0, 1.0]))

    def test_orthogonal_pair_is_the_sum(self):
        """a.b = 0 is no conflict."""
        a, b = arrays([1.0, 0.0]), arrays([0.0, 3.0])
        self.assertAllClose(project([a, b], [1, 0]), arrays([1.0, 3.0]))

    def test_flattened_over_variables_with_none(self):
        """None counts as zeros when flattening over variables."""
        # Flattened a = (1, 0, 0), b = (-1, 1, 2): a.b = -1, |b|^2 = 6,
        # |a|^2 = 1. a -> a + b/6 = (5/6, 1/6, 1/3), b -> b + a = (0, 1, 2);
        # the sum (5/6, 7/6, 7/3) is split back per variable.
        a = [np.array([1.0, 0.0], "float32"), None]
        b = arrays([-1.0, 1.0], [2.0])
        result = project([a, b], [0, 1])
        self.assertAllClose(result, arrays([5 / 6, 7 / 6], [7 / 3]), atol=1e-6)

    def test_variable_without_any_gradient_keeps_none(self):
        """A variable that no task reaches keeps None; shapes are kept."""
        a = [np.array([[1.0, 2.0], [3.0, 4.0]], "float32"), None]
        b = [np.array([[-1.0, 0.0], [0.0, 0.0]], "float32"), None]
        result = project([a, b], [1, 0])
        self.assertIsNone(result[1])
        # a.b = -1, |a|^2 = 30, |b|^2 = 1: a -> a + b, b -> b + a/30.
        expected = a[0] + b[0] + b[0] + a[0] / 30.0
        self.assertEqual(result[0].shape, (2, 2))
        self.assertAllClose(result[0], expected, atol=1e-6)

    def test_three_tasks_follow_the_order_against_original_gradients(self):
        """Three tasks follow the given order (list or tensor)."""
        tasks = [
            arrays([1.0, 0.0, 0.0]),
            arrays([-1.0, 1.0, 0.0]),
            arrays([-1.0, -2.0, 1.0]),
        ]
        results = {}
        for order in itertools.permutations(range(3)):
            expected = numpy_pcgrad(tasks, list(order))
            self.assertAllClose(
                project(tasks, list(order)), expected, atol=1e-6
            )
            as_tensor = ops.convert_to_tensor(list(order), "int32")
            self.assertAllClose(project(tasks, as_tensor), expected, atol=1e-6)
            results[order] = expected[0]
        self.assertGreater(
            max(np.abs(r - results[(0, 1, 2)]).max() for r in results.values()),
            1e-3,
        )

    def test_hand_computed_three_task_case(self):
        """Three tasks in order (0, 1, 2), computed by hand."""
        # a: .b = -1 -> (0.5, 0.5); then .c = -0.5 -> (0.5, 0).
        # b: .a = -1 -> (0, 1); then .c = -1 -> (0, 0).
        # c: .a = 0; .b = -1 -> c + b/2 = (-0.5, -0.5). Sum: (0, -0.5).
        tasks = [arrays([1.0, 0.0]), arrays([-1.0, 1.0]), arrays([0.0, -1.0])]
        self.assertAllClose(
            project(tasks, [0, 1, 2]), arrays([0.0, -0.5]), atol=1e-6
        )

    def test_task_is_not_projected_against_itself(self):
        """A task is projected only against the other tasks (the paper)."""
        # Order (0, 1, 2). Task 0: .g1 = 4, .g2 = -6 -> g0 + 6/5 g2 =
        # (0.4, -0.8). Task 1: .g0 = 4, .g2 = -4 -> g1 + 4/5 g2 = (-0.4, 0.8).
        # Task 2: .g0 = -6 -> g2 + 6/8 g0 = (0.5, -0.5); .g1 = -1 -> + g1/4 =
        # (0, -0.5). Sum: (0, -0.5). Projecting task 2 against g2 itself too,
        # since (0, -0.5).g2 = -0.5 < 0, would give (0.2, -0.4).
        tasks = [arrays([-2.0, -2.0]), arrays([-2.0, 0.0]), arrays([2.0, 1.0])]
        self.assertAllClose(numpy_pcgrad(tasks, [0, 1, 2]), arrays([0.0, -0.5]))
        self.assertAllClose(
            project(tasks, [0, 1, 2]), arrays([0.0, -0.5]), atol=1e-6
        )


class InvalidOptionsTest(testing.TestCase):
    @parameterized.named_parameters(
        ("true", True),
        ("unknown", "x"),
    )
    def test_invalid_per_loss_gradients(self, value):
        """per_loss_gradients other than its three values is refused."""
        with self.assertRaisesRegex(ValueError, "per_loss_gradients"):
            testing.mlp(Summed, per_loss_gradients=value)

    def test_pcgrad_needs_per_loss_gradients(self):
        """PCGradMixin refuses per_loss_gradients=False."""
        with self.assertRaisesRegex(ValueError, "per_loss_gradients"):
            multi_task_model(PCGradNet, per_loss_gradients=False)

    @parameterized.named_parameters(
        ("negative", -1),
        ("float", 1.5),
        ("string", "1"),
    )
    def test_invalid_pcgrad_seed(self, value):
        """pcgrad_seed must be an integer >= 0 or None."""
        with self.assertRaisesRegex(ValueError, "pcgrad_seed"):
            multi_task_model(PCGradNet, pcgrad_seed=value)

    def test_valid_seeds_are_accepted(self):
        """0 and None are valid seeds."""
        for seed in (0, None, 3):
            self.assertEqual(
                multi_task_model(PCGradNet, pcgrad_seed=seed).pcgrad_seed, seed
            )


class RecompiledTest(testing.TestCase):
    @parameterized.named_parameters(*testing.EXECUTION_MODES)
    def test_compiled_again_with_fewer_tasks(self, mode):
        """A model compiled again with two of its three losses trains on:
        one step of NumPy PCGrad of three tasks in the order it showed,
        then one of two tasks (any order), as a hand-run SGD; its
        `task_order` is then of two tasks."""
        x, y = multi_task_data()
        model = compiled(multi_task_model(PCGradNet, pcgrad_seed=3), **mode)
        fit(model, x, y, batch_size=len(x))
        first = model.task_order
        self.assertEqual(sorted(first), [0, 1, 2])
        model.compile(
            optimizer=keras.optimizers.SGD(RATE),
            loss={"a": None, "b": losses()["b"], "c": losses()["c"]},
            loss_weights={"a": None, "b": WEIGHTS["b"], "c": WEIGHTS["c"]},
            **mode,
        )
        with warnings.catch_warnings():
            # Head `a` has no loss now: Keras' optimizer warns of its
            # missing gradients (TensorFlow, PyTorch) and leaves it.
            warnings.filterwarnings("ignore", "Gradients do not exist")
            fit(model, x, y, batch_size=len(x))
        self.assertEqual(sorted(model.task_order), [0, 1])
        oracle = multi_task_model()
        for tasks, order in (("abc", first), ("bc", [0, 1])):
            grads = [task_gradients(oracle, x, y, name) for name in tasks]
            sgd_step(oracle, numpy_pcgrad(grads, order))
        self.assertWeightsClose(model, oracle, atol=2e-6)
