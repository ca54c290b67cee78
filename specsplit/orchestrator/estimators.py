"""The running estimates the cost model is made of (torch-free): a weighted least-squares line,
one forward size's measured cost, one calibration cell's hits, an exponential average. Each
constant here says why it has its value; ``specsplit.orchestrator.costmodel`` uses them."""

from __future__ import annotations

from dataclasses import dataclass

CELL_WEIGHT = 0.15  # a size's cost: exponential average with this weight on the newest forward
CELL_PRIOR = 1.0  # the line's estimate counts as this many forwards of a size measured few times
CELL_SEEN_MAX = 1.0 / CELL_WEIGHT  # forwards a size's count stops at: about its average's memory
EWMA_WEIGHT = 0.2  # the other averages' (overhead, rate, load) newest weight: follows load in a few rounds
MIN_VARIANCE = 1e-6  # a variance of x below this is rounding, not sizes that varied: the line has no slope


def ewma(old: float | None, new: float, weight: float = EWMA_WEIGHT) -> float:
    return new if old is None else (1.0 - weight) * old + weight * new


@dataclass(slots=True)
class LineFit:
    """Exponentially weighted least-squares sums of (x, y) observations: their weight ``n`` and
    the weighted sums of x, y, x*x and x*y."""

    n: float = 0.0
    x: float = 0.0
    y: float = 0.0
    xx: float = 0.0
    xy: float = 0.0

    def observe(self, x: float, y: float, decay: float) -> None:
        """Add (x, y), every earlier observation's weight times ``decay``."""
        self.n = self.n * decay + 1.0
        self.x = self.x * decay + x
        self.y = self.y * decay + y
        self.xx = self.xx * decay + x * x
        self.xy = self.xy * decay + x * y

    def line(self) -> tuple[float, float]:
        """(intercept, slope); slope 0 until x varies, neither negative; (0, 0) with no
        observations. Observed (1, 3) and (3, 7): (1.0, 2.0)."""
        n, sx, sy = self.n, self.x, self.y
        if n <= 0:
            return 0.0, 0.0
        var = self.xx / n - (sx / n) ** 2
        slope = max(0.0, (self.xy / n - (sx / n) * (sy / n)) / var) if var > MIN_VARIANCE else 0.0
        return max(0.0, sy / n - slope * sx / n), slope

    def y_per_x(self) -> float | None:
        """Weighted y per unit of x over every observation (None before any x)."""
        return self.y / self.x if self.n > 0 and self.x > 0 else None


@dataclass(slots=True)
class SizeCost:
    """One forward size's measured verify cost: an exponential average and the forwards it has
    seen (capped at ``CELL_SEEN_MAX``)."""

    ms: float = 0.0
    seen: float = 0.0

    @property
    def measured(self) -> bool:
        return self.seen > 0

    def observe(self, ms: float) -> None:
        self.ms = ewma(self.ms if self.seen > 0 else None, ms, CELL_WEIGHT)
        self.seen = min(self.seen + 1.0, CELL_SEEN_MAX)

    def price(self, line: float) -> float:
        """Its cost, with the line's estimate ``line`` weighing in while few forwards were seen."""
        return (self.seen * self.ms + CELL_PRIOR * line) / (self.seen + CELL_PRIOR)


@dataclass(slots=True)
class Hits:
    """How often nodes of one calibration cell ended on the accepted path."""

    hits: float = 0.0
    total: float = 0.0

    def add(self, hit: bool) -> None:
        if hit:
            self.hits += 1.0
        self.total += 1.0

    def posterior(self, prior_mean: float, prior_weight: float) -> float:
        """The hit rate smoothed toward ``prior_mean``, which counts as ``prior_weight``
        observations: 3 hits of 4 toward 0.5 weighing 2 give (3 + 1) / (4 + 2)."""
        return (self.hits + prior_weight * prior_mean) / (self.total + prior_weight)
