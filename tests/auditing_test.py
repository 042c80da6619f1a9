"""`custom_fit.auditing.epsilon_lower_bound`, the one-run audit statistic.

Oracles: mechanisms whose epsilon is known exactly (randomized response,
for which a one-run bound can come close to the truth, and the Gaussian
mechanism, whose epsilon dp-accounting computes), run over 200 seeds: a
valid bound at 95% confidence exceeds the truth in at most 5% of runs.
The p-value at one threshold is checked against SciPy's binomial
distribution, and the bounds on deterministic normal scores against the
figures another implementation (jax_privacy's `epsilon_one_run`) publishes
for them.
"""

import dp_accounting
import numpy as np
import pytest
import scipy.stats
from absl.testing import parameterized

from custom_fit import auditing

SEEDS = 200


def randomized_response(epsilon, canaries, seed):
    """Canaries included with probability 1/2, each scored 1 or 0: its
    inclusion, flipped with probability 1 / (1 + e^eps), which is
    eps-DP for each canary and no better."""
    rng = np.random.default_rng(seed)
    included = rng.random(canaries) < 0.5
    flipped = rng.random(canaries) < 1.0 / (1.0 + np.exp(epsilon))
    scores = (included ^ flipped).astype(np.float64)
    return scores[included], scores[~included]


def gaussian_mechanism(noise, canaries, seed):
    """Canaries included with probability 1/2, each scored by its
    inclusion (sensitivity 1) plus Gaussian noise of std `noise`."""
    rng = np.random.default_rng(seed)
    included = rng.random(canaries) < 0.5
    scores = included + rng.normal(scale=noise, size=canaries)
    return scores[included], scores[~included]


def deterministic_normal(shift, count):
    """`count` evenly spaced quantiles of N(shift, 1)."""
    levels = (np.arange(count) + 0.5) / count
    return scipy.stats.norm.ppf(levels) + shift


@pytest.mark.backend_independent  # NumPy and SciPy only
class EpsilonLowerBoundTest(parameterized.TestCase):
    @parameterized.parameters(1.0, 2.0)
    def test_valid_on_randomized_response(self, epsilon):
        """Pure eps-DP randomized response on 1,000 canaries: at most 5% of
        200 runs' bounds exceed eps, and the bound is not vacuous (its
        median is at least half of eps: the test can tell a bound that
        ignores the scores)."""
        bounds = np.asarray(
            [
                auditing.epsilon_lower_bound(
                    *randomized_response(epsilon, 1000, seed), delta=0.0
                )
                for seed in range(SEEDS)
            ]
        )
        self.assertLessEqual(np.mean(bounds > epsilon), 0.05)
        self.assertGreater(np.median(bounds), 0.5 * epsilon)

    def test_valid_on_the_gaussian_mechanism(self):
        """The Gaussian mechanism (noise 0.5, sensitivity 1) on 1,000
        canaries at delta 1e-5: at most 5% of 200 bounds exceed the epsilon
        dp-accounting computes for it, and every bound finds a leak (> 1)."""
        truth = dp_accounting.get_epsilon_gaussian(0.5, 1e-5)
        bounds = np.asarray(
            [
                auditing.epsilon_lower_bound(
                    *gaussian_mechanism(0.5, 1000, seed), delta=1e-5
                )
                for seed in range(SEEDS)
            ]
        )
        self.assertLessEqual(np.mean(bounds > truth), 0.05)
        self.assertGreater(bounds.min(), 1.0)

    @parameterized.parameters((1, 1.133), (2, 2.312), (4, 4.396))
    def test_deterministic_normal_scores(self, shift, published):
        """10,000 scores per side, N(shift, 1) against N(0, 1), delta 1e-6,
        95%: no lower than jax_privacy's published `epsilon_one_run` (it
        corrects over every threshold on the ROC's hull; this bound over
        a fixed grid of quarter octaves) and below the true epsilon of the
        Gaussian mechanism these scores are quantiles of."""
        bound = auditing.epsilon_lower_bound(
            deterministic_normal(shift, 10_000),
            deterministic_normal(0.0, 10_000),
            delta=1e-6,
        )
        self.assertGreaterEqual(bound, published)
        self.assertLess(
            bound, dp_accounting.get_epsilon_gaussian(1.0 / shift, 1e-6)
        )

    @parameterized.parameters(
        (1000, 40, 36, 1.0, 0.0),
        (1000, 40, 36, 1.0, 1e-5),
        (200, 10, 10, 0.3, 1e-3),
        (5000, 300, 250, 1.5, 1e-6),
    )
    def test_p_value_is_the_theorem_s(
        self, canaries, guesses, right, eps, delta
    ):
        """The bound's p-value at one threshold equals Theorem 3.1's,
        written with SciPy's binomial: P[B >= v] + 2 m delta max_i
        P[v - i <= B < v] / i, B ~ Binomial(r, e^eps / (1 + e^eps))."""
        binomial = scipy.stats.binom(guesses, 1.0 / (1.0 + np.exp(-eps)))
        alpha = max(
            (binomial.cdf(right - 1) - binomial.cdf(right - i - 1)) / i
            for i in range(1, right + 1)
        )
        expected = min(
            binomial.sf(right - 1) + 2 * canaries * delta * alpha, 1.0
        )
        self.assertAlmostEqual(
            auditing._p_value(eps, canaries, guesses, right, delta),
            expected,
            delta=1e-12 + 1e-9 * expected,
        )

    def test_a_leak_above_the_claim_is_found(self):
        """Randomized response at eps 3 refutes a claim of eps 1: the
        bound of one run of 2,000 canaries exceeds 1."""
        bound = auditing.epsilon_lower_bound(
            *randomized_response(3.0, 2000, seed=0), delta=1e-5
        )
        self.assertGreater(bound, 1.0)

    def test_no_signal_gives_zero(self):
        """Scores independent of inclusion refute nothing."""
        rng = np.random.default_rng(0)
        bound = auditing.epsilon_lower_bound(
            rng.normal(size=500), rng.normal(size=500), delta=1e-5
        )
        self.assertEqual(bound, 0.0)

    @parameterized.named_parameters(
        ("empty", {"in_scores": []}, "in_scores"),
        ("two_d", {"out_scores": np.zeros((2, 2))}, "out_scores"),
        ("nan", {"in_scores": [1.0, np.nan]}, "in_scores"),
        ("delta_one", {"delta": 1.0}, "delta=1.0"),
        ("delta_negative", {"delta": -1e-5}, "delta=-1e-05"),
        ("confidence_low", {"confidence": 0.4}, "confidence=0.4"),
        ("confidence_one", {"confidence": 1.0}, "confidence"),
    )
    def test_bad_arguments_are_named(self, override, message):
        arguments = {
            "in_scores": [1.0, 2.0],
            "out_scores": [0.0, 1.0],
            "delta": 1e-5,
            **override,
        }
        with self.assertRaisesRegex(ValueError, message):
            auditing.epsilon_lower_bound(**arguments)
