"""Bayesian optimisation with a Gaussian process and expected improvement, in NumPy.

The autotuner (``hora.engine.autotune``) maximises a noisy score over a box of
parameters. This module knows nothing of engines: it proposes points of the unit cube
``[0, 1]^d`` and learns the score of each point it is told.

* The model: a Gaussian process with a squared-exponential kernel (one length scale, the
  one of a small grid that maximises the marginal likelihood of what was seen), on
  scores standardised to mean 0 and variance 1, with ``noise`` added to the kernel's
  diagonal (Horovod's ``HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE``, in those units: 0.8
  says that two samples of one point may differ by most of the spread between points).
* The next point: the one of many random candidates (seeded: the same scores give the
  same proposals) with the highest expected improvement over the best mean seen.

Nothing here raises on a degenerate history (one point, equal scores): the model then
has no information and expected improvement is the prior's, so the proposals explore.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
from numpy.typing import NDArray

Array = NDArray[np.float64]

LENGTH_SCALES = (0.05, 0.1, 0.2, 0.35, 0.6, 1.0)  # in units of the unit cube's side
CANDIDATES = 2048  # random points scored by expected improvement per proposal
XI = 0.01  # exploration margin of expected improvement, in standardised score units
_JITTER = 1e-9


def _kernel(a: Array, b: Array, length: float) -> Array:
    """Squared-exponential kernel between the rows of ``a`` and ``b``."""
    distances = ((a[:, None, :] - b[None, :, :]) ** 2).sum(axis=-1)
    result: Array = np.exp(-0.5 * distances / (length * length))
    return result


def _normal_cdf(z: Array) -> Array:
    erf = np.vectorize(math.erf, otypes=[np.float64])
    result: Array = 0.5 * (1.0 + erf(z / math.sqrt(2.0)))
    return result


def _normal_pdf(z: Array) -> Array:
    result: Array = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return result


class GaussianProcess:
    """A Gaussian process regression on standardised targets.

    Args:
        noise: added to the kernel's diagonal (standardised units); >= 0.
    """

    def __init__(self, noise: float) -> None:
        self.noise = max(noise, 0.0)
        self.length = LENGTH_SCALES[2]
        self._x: Array = np.zeros((0, 0))
        self._alpha: Array = np.zeros(0)
        self._chol: Array = np.zeros((0, 0))
        self._mean = 0.0
        self._scale = 1.0

    def fit(self, x: Array, y: Array) -> None:
        """Learns scores ``y`` (n) at points ``x`` (n x d), choosing the length scale."""
        self._mean = float(y.mean())
        spread = float(y.std())
        self._scale = spread if spread > 0 else 1.0
        target = (y - self._mean) / self._scale
        best: tuple[float, float, Array, Array] | None = None
        for length in LENGTH_SCALES:
            chol, alpha = self._factor(x, target, length)
            # log marginal likelihood, up to a constant
            evidence = -0.5 * float(target @ alpha) - float(np.log(np.diag(chol)).sum())
            if best is None or evidence > best[0]:
                best = (evidence, length, chol, alpha)
        assert best is not None  # invariant: LENGTH_SCALES is not empty
        _, self.length, self._chol, self._alpha = best
        self._x = x

    def _factor(self, x: Array, target: Array, length: float) -> tuple[Array, Array]:
        k = _kernel(x, x, length) + (self.noise + _JITTER) * np.eye(len(x))
        chol: Array = np.linalg.cholesky(k).astype(np.float64)
        alpha: Array = np.linalg.solve(chol.T, np.linalg.solve(chol, target))
        return chol, alpha

    def predict(self, x: Array) -> tuple[Array, Array]:
        """The posterior mean and standard deviation at the rows of ``x``, in score units."""
        k = _kernel(x, self._x, self.length)
        mean = k @ self._alpha
        v = np.linalg.solve(self._chol, k.T)
        variance = np.clip(1.0 - (v * v).sum(axis=0), 1e-12, None)
        return mean * self._scale + self._mean, np.sqrt(variance) * self._scale


class BayesianOptimizer:
    """Proposes points of ``[0, 1]^dims`` to maximise a noisy score.

    Args:
        dims: the number of parameters.
        noise: the Gaussian process's noise (see the module doc).
        seed: seeds the random candidates, so a history gives the same proposals.

    Usage: ``x = opt.suggest()``, measure ``score(x)``, ``opt.observe(x, score)``,
    repeat; ``opt.best()`` is the point of the highest score seen.
    """

    def __init__(self, dims: int, noise: float = 0.8, seed: int = 0) -> None:
        self.dims = dims
        self._gp = GaussianProcess(noise)
        self._rng = np.random.default_rng(seed)
        self.points: list[Array] = []
        self.scores: list[float] = []

    def observe(self, point: Array, score: float) -> None:
        """Records the score measured at ``point``."""
        self.points.append(np.clip(np.asarray(point, dtype=np.float64), 0.0, 1.0))
        self.scores.append(float(score))

    def suggest(self, fresh: Callable[[Array], bool] | None = None) -> Array:
        """The next point to measure: the candidate of the highest expected improvement
        (a random point while nothing has been observed).

        Args:
            fresh: says whether a candidate is worth measuring (a caller that rounds
                points to a grid passes "its grid point was not measured yet"); the
                best candidate it accepts is chosen, or the best of all if it accepts
                none. Asked in order of expected improvement, so usually a few times.
        """
        candidates = self._rng.random((CANDIDATES, self.dims))
        if not self.points:
            result: Array = candidates[0]
            return result
        x = np.stack(self.points)
        y = np.asarray(self.scores, dtype=np.float64)
        self._gp.fit(x, y)
        order = np.argsort(-self.expected_improvement(candidates), kind="stable")
        if fresh is not None:
            for index in order.tolist():
                if fresh(candidates[index]):
                    accepted: Array = candidates[index]
                    return accepted
        chosen: Array = candidates[int(order[0])]
        return chosen

    def expected_improvement(self, candidates: Array) -> Array:
        """Expected improvement at each row of ``candidates`` over the best posterior mean
        at the points seen (the model fitted by the last ``suggest``)."""
        mean, std = self._gp.predict(candidates)
        seen_mean, _ = self._gp.predict(np.stack(self.points))
        margin = XI * self._gp._scale
        improvement = mean - float(seen_mean.max()) - margin
        z = improvement / std
        result: Array = improvement * _normal_cdf(z) + std * _normal_pdf(z)
        return result

    def best(self) -> tuple[Array, float]:
        """The point of the highest score observed, and that score.

        Raises:
            ValueError: nothing has been observed.
        """
        if not self.scores:
            raise ValueError("no score observed yet")
        index = int(np.argmax(self.scores))
        return self.points[index], self.scores[index]
