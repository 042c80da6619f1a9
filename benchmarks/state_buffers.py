"""What a jitted JAX step pays per state buffer, and what packing wins back.

A lever weighed for the guarded step on JAX (BUILD_NOTES, issue 39): its
extra state travels as separate scalar buffers in and out of every call.
Three jitted toy steps of `(weight, state)` with the state donated, as the
adapter's step is: no extra state (twice: the A/A row), 13 separate scalar
buffers, and the same 13 scalars packed in one vector (sliced at entry,
each updated on its own, stacked at exit). Rounds interleave the
configurations; each row is the median over rounds of the time per call,
and its ratio to the first row.

    JAX_PLATFORMS=cpu python benchmarks/state_buffers.py
"""

import statistics
import time

import jax
import jax.numpy as jnp

ROUNDS = 9
CALLS = 2000
BUFFERS = 13
_X = jnp.ones((32, 4))


def _core(weight):
    total = jnp.tanh(_X @ weight).sum()
    return weight - 0.01 * total, total


def no_state(weight, state):
    weight, _ = _core(weight)
    return weight, state


def separate(weight, state):
    weight, total = _core(weight)
    return weight, [value * 0.5 + total for value in state]


def packed(weight, state):
    weight, total = _core(weight)
    return weight, jnp.stack(
        [state[i] * 0.5 + total for i in range(BUFFERS)]
    )


CONFIGURATIONS = (
    ("no extra state", no_state, lambda: []),
    ("no extra state (A/A)", no_state, lambda: []),
    (f"{BUFFERS} scalar buffers", separate, lambda: [jnp.zeros(())] * BUFFERS),
    ("one packed vector", packed, lambda: jnp.zeros((BUFFERS,))),
)


def main():
    steps = {
        name: jax.jit(function, donate_argnums=(0, 1))
        for name, function, _ in CONFIGURATIONS
    }
    times = {name: [] for name, _, _ in CONFIGURATIONS}
    for _ in range(ROUNDS):
        for name, _, initial in CONFIGURATIONS:
            step = steps[name]
            weight = jnp.ones((4, 64))
            state = jax.tree.map(jnp.copy, initial())
            for _ in range(200):
                weight, state = step(weight, state)
            jax.block_until_ready(weight)
            start = time.perf_counter()
            for _ in range(CALLS):
                weight, state = step(weight, state)
            jax.block_until_ready(weight)
            times[name].append((time.perf_counter() - start) / CALLS * 1e6)
    base = statistics.median(times[CONFIGURATIONS[0][0]])
    print(f"{'configuration':24s} {'us/call':>8s} {'ratio':>6s}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:24s} {median:8.1f} {median / base:6.2f}")


if __name__ == "__main__":
    main()
