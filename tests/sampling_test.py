"""PoissonSampler against the distribution it claims: batch sizes from
Binomial(n, q) (a chi-square goodness-of-fit test), each example included
with probability q independently of the others (per-example frequencies and
a chi-square dispersion test), and its batches as `fit` receives them."""

import numpy as np
import pytest
from scipy import stats

from custom_fit import sampling
from tests import testing

# A test statistic is accepted when its p-value is above this (fixed seeds:
# the tests are deterministic; the threshold says how unlucky a correct
# sampler would have to be to fail).
P_VALUE = 1e-3


def draws(sampler, count):
    """The example indices of `count` batches, across several epochs."""
    per_epoch = len(sampler)
    return [
        sampler.indices(number // per_epoch, number % per_epoch)
        for number in range(count)
    ]


def pooled_chi_square(observed, expected, minimum=5.0):
    """Chi-square test of counts against expected counts, adjacent bins
    pooled until each expects at least `minimum`; returns the p-value."""
    pooled_observed, pooled_expected = [], []
    observed_sum = expected_sum = 0.0
    for o, e in zip(observed, expected):
        observed_sum += o
        expected_sum += e
        if expected_sum >= minimum:
            pooled_observed.append(observed_sum)
            pooled_expected.append(expected_sum)
            observed_sum = expected_sum = 0.0
    pooled_observed[-1] += observed_sum
    pooled_expected[-1] += expected_sum
    return stats.chisquare(pooled_observed, pooled_expected).pvalue


@pytest.mark.backend_independent  # the sampler's draws are NumPy's
class PoissonSamplerTest(testing.TestCase):
    def sampler(self, num_examples=200, batch_size=20, **kwargs):
        x = np.arange(num_examples, dtype="float32").reshape(-1, 1)
        y = np.arange(num_examples) % 3
        return sampling.PoissonSampler(x, y, batch_size, seed=1, **kwargs)

    def test_batch_sizes_follow_the_binomial_distribution(self):
        """The sizes of 4,000 batches fit Binomial(n, q) (chi-square over
        every size, tails pooled), and their mean is n * q."""
        sampler = self.sampler()
        sizes = np.array([len(d) for d in draws(sampler, 4000)])
        n, q = sampler.num_examples, sampler.sampling_rate
        support = np.arange(n + 1)
        observed = np.bincount(sizes, minlength=n + 1)
        expected = stats.binom.pmf(support, n, q) * len(sizes)
        self.assertGreater(pooled_chi_square(observed, expected), P_VALUE)
        self.assertLess(
            abs(sizes.mean() - n * q),
            5 * np.sqrt(n * q * (1 - q) / len(sizes)),
        )

    def test_every_example_is_included_with_probability_q(self):
        """Over 4,000 batches each example's inclusion count is
        Binomial(4000, q): every one within 5 standard deviations, and the
        sum of their squared standardized deviations is chi-square with n
        degrees of freedom (independent examples)."""
        sampler = self.sampler()
        batches = draws(sampler, 4000)
        counts = np.bincount(
            np.concatenate(batches), minlength=sampler.num_examples
        )
        q, trials = sampler.sampling_rate, len(batches)
        z = (counts - trials * q) / np.sqrt(trials * q * (1 - q))
        self.assertLess(np.abs(z).max(), 5.0)
        self.assertGreater(
            stats.chi2.sf(np.sum(z**2), df=sampler.num_examples), P_VALUE
        )
        self.assertLess(
            stats.chi2.cdf(np.sum(z**2), df=sampler.num_examples),
            1 - P_VALUE,
        )

    def test_two_examples_are_included_independently(self):
        """The share of batches holding both of two examples is q^2 (and
        not q, nor 0): inclusions are independent."""
        sampler = self.sampler()
        batches = draws(sampler, 4000)
        both = np.mean([(3 in b) and (150 in b) for b in batches])
        q = sampler.sampling_rate
        self.assertLess(
            abs(both - q**2), 5 * np.sqrt(q**2 * (1 - q**2) / len(batches))
        )

    def test_draws_are_reproducible_and_fresh(self):
        """The same seed gives the same batches; another batch index,
        another epoch or another seed gives others."""
        a, b = self.sampler(), self.sampler()
        self.assertAllClose(a.indices(2, 3), b.indices(2, 3), atol=0)
        self.assertFalse(np.array_equal(a.indices(2, 3), a.indices(2, 4)))
        self.assertFalse(np.array_equal(a.indices(2, 3), a.indices(3, 3)))
        x = np.zeros((200, 1), "float32")
        other = sampling.PoissonSampler(x, np.zeros(200), 20, seed=2)
        self.assertFalse(np.array_equal(a.indices(2, 3), other.indices(2, 3)))

    def test_batches_hold_the_sampled_examples_then_zero_weight_padding(self):
        """A batch is the sampled rows of x, y and the sample weights, in
        order, then rows of zeros of weight 0 up to a multiple of
        pad_to_multiple_of; epochs advance with on_epoch_end."""
        num_examples = 200
        x = np.random.RandomState(0).normal(size=(num_examples, 2))
        y = np.arange(num_examples) % 3
        weights = np.random.RandomState(1).uniform(0.5, 2, num_examples)
        sampler = sampling.PoissonSampler(
            {"a": x, "b": x[:, :1]},
            y,
            batch_size=20,
            sample_weight=weights,
            seed=3,
            pad_to_multiple_of=8,
        )
        self.assertLen(sampler, 10)
        for epoch in range(2):
            for index in range(3):
                chosen = sampler.indices(epoch, index)
                bx, by, bw = sampler[index]
                rows = len(by)
                self.assertEqual(rows % 8, 0)
                self.assertBetween(rows - len(chosen), 0, 7)
                kept = len(chosen)
                self.assertAllClose(bx["a"][:kept], x[chosen], atol=0)
                self.assertAllClose(bx["b"][:kept], x[chosen, :1], atol=0)
                self.assertAllClose(by[:kept], y[chosen], atol=0)
                self.assertAllClose(bw[:kept], weights[chosen], atol=1e-7)
                self.assertAllClose(bw[kept:], 0.0, atol=0)
                self.assertAllClose(bx["a"][kept:], 0.0, atol=0)
            sampler.on_epoch_end()

    def test_an_empty_batch_is_one_row_of_weight_zero(self):
        """Poisson sampling can draw no example: the batch is then one
        padding row, whose weight 0 makes it count for nothing."""
        sampler = self.sampler(
            num_examples=50, batch_size=1, pad_to_multiple_of=1
        )
        empty = next(i for i in range(100) if len(sampler.indices(0, i)) == 0)
        bx, by, bw = sampler[empty]
        self.assertEqual(bx.shape, (1, 1))
        self.assertAllClose(bw, [0.0], atol=0)

    def test_auto_padding_is_about_the_standard_deviation(self):
        """ "auto" pads to the power of two nearest sqrt(batch_size)."""
        for batch_size, multiple in ((1, 1), (16, 4), (64, 8), (256, 16)):
            sampler = self.sampler(num_examples=1000, batch_size=batch_size)
            self.assertEqual(sampler.pad_to_multiple_of, multiple)

    def test_bad_arguments_are_named(self):
        x, y = np.zeros((10, 2)), np.zeros(10)
        for arguments, received in (
            (dict(batch_size=0), "batch_size=0"),
            (dict(batch_size=11), "batch_size=11"),
            (dict(batch_size=2, seed=-1), "seed=-1"),
            (dict(batch_size=2, pad_to_multiple_of=0), "pad_to_multiple_of=0"),
            (
                dict(batch_size=2, sample_weight=np.ones(3)),
                r"shape \(3,\)",
            ),
        ):
            with self.assertRaisesRegex(ValueError, received):
                sampling.PoissonSampler(x, y, **arguments)
        with self.assertRaisesRegex(ValueError, r"\[9, 10\]"):
            sampling.PoissonSampler(x, y[:9], batch_size=2)
