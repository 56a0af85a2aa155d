"""A cost model of hora's collectives across hosts, fitted to measured runs.

Every algorithm hora runs across hosts is a sequence of *steps*: exchanges with a ring
neighbour or a partner that each wait for the previous one. The model prices a
collective as

    T = steps * alpha + wire * beta

* ``alpha``: the fixed cost of one step, seconds: the link's latency plus hora's work per
  step (a pass of the transfer loop in Python, a wake-up);
* ``wire``: the bytes the busiest host link carries in one direction;
* ``beta``: seconds per byte on that link: ``1 / bandwidth`` of a shaped link, or of
  what the CPUs move when the link is not the bottleneck.

``alpha`` and ``beta`` are fitted (least squares, both non-negative) to times measured
on the emulated cluster (``benchmarks/cluster.py --json``), one pair per link rate. The
fitted model then predicts each algorithm at sizes nobody can run here (64, 256 and
1,024 ranks, 8 per host) and says which algorithm is cheapest where, next to the one
hora picks (``hora_allreduce``). Within a host the hierarchical path moves data through
shared memory, priced per byte of the buffer at ``local_beta`` (from the machine's
memcpy bandwidth; see ``hierarchical_allreduce``).

    python -m hora.bench.model cluster-1gbit.json [more.json ...]

``docs/scaling.md`` has the fitted constants, the check against N = 2..8 and the
predictions.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hora.collectives import pipeline
from hora.engine.algorithms import DOUBLING_MAX_BYTES, SCATTER_BROADCAST_MIN_BYTES, TREE_BROADCAST_MIN_BYTES

Cost = tuple[float, float]
"""(steps, wire bytes) of one collective."""


@dataclasses.dataclass(frozen=True)
class Link:
    """Fitted constants of one link rate.

    Attributes:
        alpha: seconds per step.
        beta: seconds per byte on the busiest host link.
        fixed: seconds per collective, whatever its size and steps: announcing it to
            the coordinator and hearing back (negotiation), handing it to the engine.
        per_rank: seconds per collective per rank of the job, measured where all ranks
            share one machine's cores (the emulated cluster): each rank's Python work for
            a collective runs in turn with the others'. Predictions for hosts with cores
            of their own count it once (``time(..., ranks=1)``).
    """

    alpha: float
    beta: float
    fixed: float = 0.0
    per_rank: float = 0.0

    def time(self, cost: Cost, ranks: int = 1) -> float:
        steps, wire = cost
        return self.fixed + self.per_rank * ranks + steps * self.alpha + wire * self.beta


# ----- algorithms: (steps, bytes on the busiest link), one rank per host -----


def ring_allreduce(n: int, size: float) -> Cost:
    """Reduce-scatter then allgather around the ring: 2(n-1) steps of size/n."""
    return (2 * (n - 1), 2 * (n - 1) / n * size) if n > 1 else (0, 0)


def doubling_allreduce(n: int, size: float) -> Cost:
    """Recursive doubling: log2 p exchanges of the whole buffer, two more when n is not a power of two."""
    if n <= 1:
        return (0, 0)
    p = 1 << (n.bit_length() - 1)
    steps = int(math.log2(p)) + (2 if n > p else 0)
    return (steps, steps * size)


def halving_allreduce(n: int, size: float) -> Cost:
    """Recursive halving, then doubling (Rabenseifner's allreduce, n a power of two): the
    ring's bytes in 2 log2 n steps. hora does not run it: on 4 and 8 emulated hosts it
    measured no faster than the ring (docs/scaling.md), which the model does not explain."""
    return (2 * (n.bit_length() - 1), 2 * (n - 1) / n * size) if n > 1 else (0, 0)


def ring_allgather(n: int, size: float) -> Cost:
    """Ring allgather (and reduce-scatter) of ``size`` bytes in all: n-1 steps of size/n."""
    return (n - 1, (n - 1) / n * size) if n > 1 else (0, 0)


def direct_broadcast(n: int, size: float) -> Cost:
    """The root sends the whole buffer to every other rank at once."""
    return (1, (n - 1) * size) if n > 1 else (0, 0)


def tree_broadcast(n: int, size: float) -> Cost:
    """Along a binomial tree (``pointwise.tree_broadcast``): ceil(log2 n) transfers of the
    whole buffer, one after the other."""
    steps = (n - 1).bit_length()
    return (steps, steps * size)


def scatter_allgather_broadcast(n: int, size: float) -> Cost:
    """Scatter 1/n to each rank, then a ring allgather."""
    return (n, 2 * (n - 1) / n * size) if n > 1 else (0, 0)


def chain_broadcast(n: int, size: float) -> Cost:
    """Along the ring as a pipelined chain of chunks (``pipeline.broadcast``): the first
    chunk takes n-1 hops, every link carries the buffer once, and the last rank is n-2
    chunks behind the root."""
    if n <= 1:
        return (0, 0)
    chunk = min(size, pipeline.broadcast_chunk_bytes(n, int(size)))
    return (n - 1, size + (n - 2) * chunk)


def hora_allreduce_flat(n: int, size: float) -> Cost:
    """What hora's TCP path runs for one rank per host (``TcpCollectives.allreduce``)."""
    return doubling_allreduce(n, size) if size <= DOUBLING_MAX_BYTES else ring_allreduce(n, size)


def hora_broadcast(n: int, size: float) -> Cost:
    """What hora's TCP path runs for broadcast (``TcpCollectives.broadcast``)."""
    if n > 2 and size >= SCATTER_BROADCAST_MIN_BYTES:
        return chain_broadcast(n, size) if pipeline.chains(n, int(size)) else scatter_allgather_broadcast(n, size)
    if n > 2 and size >= TREE_BROADCAST_MIN_BYTES:
        return tree_broadcast(n, size)
    return direct_broadcast(n, size)


# ----- several ranks per host -----


def hierarchical_allreduce(
    link: Link, hosts: int, per_host: int, size: float, local_beta: float, cross: Callable[[int, float], Cost]
) -> float:
    """Shared-memory reduce-scatter in each host, ``cross`` among the hosts, shared-memory allgather.

    Each of a host's ``per_host`` ranks runs ``cross`` on its 1/per_host segment, all at
    once over the host's one link: the link carries per_host times one segment's wire
    bytes, and the steps run side by side.

    Args:
        local_beta: seconds per byte of the buffer for the two shared-memory stages together.
    """
    steps, wire = cross(hosts, size / per_host)
    return link.time((steps, per_host * wire)) + size * local_beta


def flat_allreduce(
    link: Link, hosts: int, per_host: int, size: float, cross: Callable[[int, float], Cost]
) -> float:
    """One ring (or doubling) over all ranks, ordered host by host: every step crosses the
    slowest link; ranks of one host share their host's link."""
    steps, wire = cross(hosts * per_host, size)
    # A host's ring edges in and out carry the traffic of its ranks' neighbours: on a
    # ring ordered by host one edge per host crosses the network, carrying what one rank
    # sends; doubling crosses the network from every rank in the steps whose partner is
    # on another host (all but log2(per_host) of them), per_host ranks at once.
    if cross is ring_allreduce:
        return link.time((steps, wire))
    cross_steps = max(steps - int(math.log2(per_host)), 0)
    return link.time((steps, per_host * cross_steps * size))


def hora_allreduce(link: Link, hosts: int, per_host: int, size: float, local_beta: float) -> float:
    """What hora runs: hierarchical with several ranks per host (each cross-host segment
    taking doubling or the ring by its size), the flat TCP path with one."""
    if per_host == 1:
        return link.time(hora_allreduce_flat(hosts, size))
    return hierarchical_allreduce(link, hosts, per_host, size, local_beta, hora_allreduce_flat)


# ----- fitting -----


@dataclasses.dataclass(frozen=True)
class Sample:
    """One measured time: ``collective`` of ``size`` bytes on ``n`` hosts, one rank each."""

    collective: str
    n: int
    size: int
    seconds: float
    rate: str


def hora_cost(collective: str, n: int, size: float) -> Cost:
    """(steps, wire) of what hora runs for ``collective`` on ``n`` hosts, one rank each."""
    if collective == "allreduce":
        return hora_allreduce_flat(n, size)
    if collective in ("allgather", "reducescatter"):
        return ring_allgather(n, size)
    if collective == "broadcast":
        return hora_broadcast(n, size)
    raise ValueError(f"no model for {collective!r}")


def fit(samples: Sequence[Sample]) -> Link:
    """Least-squares ``fixed``, ``per_rank``, ``alpha`` and ``beta`` (all >= 0) over the
    samples of one link rate.

    Each sample is weighted by 1/time, so small and large messages count alike (the
    fit minimises relative errors). A constant that comes out negative is dropped and
    the rest refitted (a small active-set non-negative least squares).

    Raises:
        ValueError: fewer samples than constants.
    """
    if len(samples) < 4:
        raise ValueError("fitting needs at least four samples")
    features = np.array(
        [[1.0, s.n, *hora_cost(s.collective, s.n, s.size)] for s in samples], dtype=float
    )  # fixed, per_rank, alpha, beta
    times = np.array([s.seconds for s in samples])
    a = features / times[:, None]
    b = np.ones_like(times)
    active = list(range(4))
    coefficients = np.zeros(4)
    while active:
        solution, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    fixed, per_rank, alpha, beta = (float(c) for c in coefficients)
    return Link(alpha=alpha, beta=beta, fixed=fixed, per_rank=per_rank)


def relative_errors(link: Link, samples: Iterable[Sample]) -> list[float]:
    """(predicted - measured) / measured per sample."""
    return [(predict(link, s) - s.seconds) / s.seconds for s in samples]


def predict(link: Link, sample: Sample) -> float:
    """The model's time for a measured sample (on the machine it was measured on)."""
    return link.time(hora_cost(sample.collective, sample.n, sample.size), ranks=sample.n)


def load_samples(
    paths: Iterable[Path], collectives: Sequence[str] = ("allreduce", "allgather", "reducescatter", "broadcast")
) -> list[Sample]:
    """hora's times from ``benchmarks/cluster.py --json`` files (one rank per host only),
    or from a recorded list (``{"samples": [[collective, n, bytes, seconds, rate], ...]}``,
    as ``tests/recorded/cluster-1gbit.json``)."""
    samples = []
    for path in paths:
        record: dict[str, Any] = json.loads(Path(path).read_text())
        for c, n, size, seconds, rate in record.get("samples", []):
            if c in collectives:
                samples.append(Sample(c, int(n), int(size), float(seconds), str(rate)))
        for run in record.get("runs", []):
            cluster = run.get("cluster", {})
            if cluster.get("slots", 1) != 1:
                continue
            for result in run.get("backends", {}).get("hora", {}).get("results", []):
                if result["collective"] in collectives and not result.get("wrong"):
                    samples.append(Sample(result["collective"], int(run["world_size"]), int(result["bytes"]),
                                          float(result["time_s"]), str(cluster.get("rate", "none"))))  # fmt: skip
    return samples


# tbf lets a burst (125 kB at 1 Gbit/s: scripts/netns_hosts.py) through at the veth's
# speed before it holds packets to the rate, so buffers between these sizes cross the
# emulated link faster than any real link of that rate: they are left out of the fit
# (and shown beside it). Below, bytes do not matter; above, the burst is a small part.
BURST_RANGE = (2 * 1024, 1 << 20)


def fitted_samples(samples: Iterable[Sample]) -> list[Sample]:
    """The samples the fit uses: those outside ``BURST_RANGE``."""
    low, high = BURST_RANGE
    return [s for s in samples if not low < s.size < high]


# ----- predictions -----

PREDICT_RANKS = (64, 256, 1024)
PREDICT_SIZES = (4, 64 * 1024, 1 << 20, 64 << 20, 256 << 20)


def predictions(link: Link, local_beta: float, per_host: int = 8) -> list[dict[str, Any]]:
    """Allreduce times of each algorithm at ``PREDICT_RANKS`` x ``PREDICT_SIZES``, the
    cheapest of them, and hora's choice."""
    rows = []
    for ranks in PREDICT_RANKS:
        hosts = ranks // per_host
        for size in PREDICT_SIZES:
            times = {
                "flat ring": flat_allreduce(link, hosts, per_host, size, ring_allreduce),
                "flat doubling": flat_allreduce(link, hosts, per_host, size, doubling_allreduce),
                "hierarchical ring": hierarchical_allreduce(link, hosts, per_host, size, local_beta, ring_allreduce),
                "hierarchical doubling": hierarchical_allreduce(
                    link, hosts, per_host, size, local_beta, doubling_allreduce
                ),
            }
            if hosts & (hosts - 1) == 0:  # a power of two
                times["hierarchical halving"] = hierarchical_allreduce(
                    link, hosts, per_host, size, local_beta, halving_allreduce
                )
            best = min(times, key=times.__getitem__)
            rows.append({"ranks": ranks, "size": size, "times": times, "best": best,
                         "hora": hora_allreduce(link, hosts, per_host, size, local_beta)})  # fmt: skip
    return rows


def _human(size: float) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g} {unit}"
    return f"{size:g} B"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="benchmarks/cluster.py --json outputs")
    parser.add_argument("--memcpy-gbps", type=float, default=10.0,
                        help="this machine's memcpy bandwidth, for the shared-memory stages (default 10)")  # fmt: skip
    args = parser.parse_args(argv)
    samples = load_samples(args.files)
    # Reduce-scatter then allgather in shared memory: about four passes over the buffer.
    local_beta = 4.0 / (args.memcpy_gbps * 1e9)
    for rate in sorted({s.rate for s in samples}):
        chosen = [s for s in samples if s.rate == rate]
        link = fit(fitted_samples(chosen))
        errors = relative_errors(link, fitted_samples(chosen))
        print(f"# link {rate}: fixed {link.fixed * 1e6:.0f} us + {link.per_rank * 1e6:.0f} us per rank per collective, "
              f"alpha {link.alpha * 1e6:.1f} us/step, beta {link.beta * 1e9:.3f} ns/B "
              f"({1e-9 / link.beta if link.beta else float('inf'):.3f} GB/s); {len(chosen)} samples, "
              f"fitted {len(errors)}, relative error median {np.median(np.abs(errors)):.1%}, max {np.max(np.abs(errors)):.1%}")  # fmt: skip
        for s in chosen:
            e = (predict(link, s) - s.seconds) / s.seconds
            note = "" if s in fitted_samples([s]) else "  (in tbf's burst range: not fitted)"
            print(f"  {s.collective:13s} n={s.n} {_human(s.size):>10s}: measured {s.seconds * 1e3:9.3f} ms, "
                  f"model {predict(link, s) * 1e3:9.3f} ms ({e:+.1%}){note}")  # fmt: skip
        print(f"# allreduce predictions at 8 ranks per host ({rate}), ms")
        for row in predictions(link, local_beta):
            cells = "  ".join(f"{name} {t * 1e3:10.3f}" for name, t in row["times"].items())
            print(f"  {row['ranks']:5d} ranks {_human(row['size']):>10s}: {cells}  | best: {row['best']}, "
                  f"hora {row['hora'] * 1e3:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
