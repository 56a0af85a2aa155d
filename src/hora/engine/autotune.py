"""The autotuner: tunes the fusion threshold, the cycle time and the shared-memory staging
size while the job trains.

``HORA_AUTOTUNE=1`` (``horarun --autotune``) makes rank 0 measure how fast the job moves
data, try other engine parameters, and settle on the best, as Horovod's autotuner does.

What is tuned: the **fusion threshold** (64 KiB to 128 MiB, on a log scale, in steps of
64 KiB), the **cycle time** (0 to ``MAX_CYCLE_MS`` ms; the lowest tenth of its axis is 0,
hora's default: negotiate at once) and, where rank 0 shares memory with local peers, the
**staging size** (1 to 16 MiB in whole MiB, on a log scale: how much of each rank's
shared staging area one round of a collective fills; the area is mapped at its largest
at ``init()``, ``MAX_STAGING_BYTES``, and a round fills only the part in use). A knob the
user set (``HORA_FUSION_THRESHOLD``, ``HORA_CYCLE_TIME``, ``HORA_SHM_STAGING_MB`` or their
flags) is not tuned. Every other engine parameter is built into what ranks set up at
``init()`` (the fast lane's slots, each process set's algorithms); docs/autotune.md says
which and why.

Scoring. A *step* is a training step: it ends when a tensor name already seen in it comes
round again (each gradient is reduced once per step). Rank 0 counts the bytes allreduced
(fused or not, through the coordinator or the fast lane) as it finishes executing them.
A *sample* is ``steps_per_sample`` steps; its score is the bytes allreduced over its wall
time, from the step boundary that opens it to the one that closes it, in bytes per
second. The first ``warmup_samples`` samples are discarded; then each sample scores one
point (the first: the configured parameters; the next ones: Bayesian optimisation with a
Gaussian process and expected improvement, ``hora.engine.bayes``), up to
``bayes_opt_max_samples``. The tuner then settles on the point of the highest score and
keeps it. After a change, the step under way when it was sent is not counted: a sample
opens at the next step boundary.

Agreement (every rank switches at the same point of the collective sequence): rank 0
owns the tuner. A change is a ``PARAMS`` response that the coordinator appends to the
global response sequence, addressed to every rank still in the job, like a barrier's
response; each rank applies it when its executor reaches it, after every response before
it and before every one after it. The fusion threshold is used by rank 0's coordinator
alone, which switches when it emits the change; the staging size by each rank's domain
(``Domain.use_staging``), between two collectives, each of which ends with a barrier. The
fast lane never sees a change: it reads none of them. The change travels in
``Response.sizes`` as ``[PARAMS_FORMAT, fusion threshold bytes, cycle time microseconds,
staging bytes]`` (staging 0: rank 0 has no shared memory, nothing to change); a worker checks it
when the frame arrives, and anything else (another format, a missing or negative field)
is a protocol error that fails the job like any other.

Log (``HORA_AUTOTUNE_LOG``, rank 0): a CSV with Horovod's header
``hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,
cycle_time_ms,tensor_fusion_threshold,score``, then hora's own ``shm_staging_mb``, one row
per scored sample; the threshold in MiB as in Horovod, the score in bytes per second. hora
does not tune the first four columns: they hold the job's fixed settings (hierarchical: 1
unless turned off).
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import TextIO

import numpy as np

from hora import logs
from hora.collectives.reduce import DataType
from hora.config import Config
from hora.config.knobs import MIB
from hora.engine.bayes import Array, BayesianOptimizer
from hora.engine.messages import Response, ResponseType
from hora.errors import ProtocolError

log = logging.getLogger(__name__)

PARAMS_FORMAT = 2  # the layout of a PARAMS response's sizes; a new layout gets a new number
PARAMS_NAME = "autotune"  # the name a PARAMS response carries (it names no tensor)
MIN_FUSION_LOG2 = 16  # 64 KiB
MAX_FUSION_LOG2 = 27  # 128 MiB (the default)
FUSION_STEP = 64 * 1024
MAX_CYCLE_MS = 5.0
ZERO_CYCLE_SHARE = 0.1  # the lowest tenth of the cycle time's axis means 0 ms
MAX_STAGING_LOG2 = 4  # staging sizes from 2**0 to 2**4 MiB
MAX_STAGING_BYTES = (1 << MAX_STAGING_LOG2) * MIB  # what a tuned domain maps (connect_domain's reserve)
# Horovod's columns, then hora's own (a reader by name finds Horovod's where it expects them).
HEADER = ("hierarchical_allreduce", "hierarchical_allgather", "torus_allreduce", "cache_enabled",
          "cycle_time_ms", "tensor_fusion_threshold", "score", "shm_staging_mb")  # fmt: skip
FUSION = "fusion_threshold"
CYCLE = "cycle_time"
STAGING = "shm_staging"
KNOB_OF = {"HORA_FUSION_THRESHOLD": FUSION, "HORA_CYCLE_TIME": CYCLE,
           "HORA_SHM_STAGING_MB": STAGING}  # Config.autotune_fixed's names  # fmt: skip
# The responses that count towards a step: collectives of tensors (and barriers).
STEP_KINDS = frozenset((ResponseType.ALLREDUCE, ResponseType.ADASUM, ResponseType.ALLGATHER, ResponseType.BROADCAST,
                        ResponseType.ALLTOALL, ResponseType.REDUCESCATTER, ResponseType.BARRIER))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Params:
    """Engine parameters the autotuner sets.

    Attributes:
        fusion_threshold: the largest fused allreduce, bytes.
        cycle_time_us: how long a pass waits after a submit for more tensors, microseconds.
        staging_bytes: the staging area shared-memory collectives use (two halves), bytes;
            0 where rank 0 has no shared memory (then no rank changes it).
    """

    fusion_threshold: int
    cycle_time_us: int
    staging_bytes: int = 0

    @property
    def cycle_time_ms(self) -> float:
        return self.cycle_time_us / 1000.0

    @classmethod
    def of(cls, config: Config, staging_bytes: int = 0) -> Params:
        """The parameters ``config`` starts with; ``staging_bytes`` is rank 0's staging area
        in use (0: it has no shared memory)."""
        return cls(config.fusion_threshold, round(config.cycle_time_ms * 1000.0), staging_bytes)

    def response(self) -> Response:
        """The ``PARAMS`` response that carries these parameters to every rank."""
        sizes = [PARAMS_FORMAT, self.fusion_threshold, self.cycle_time_us, self.staging_bytes]
        return Response(ResponseType.PARAMS, [PARAMS_NAME], 0, sizes=sizes)

    @classmethod
    def from_response(cls, response: Response) -> Params:
        """The parameters a ``PARAMS`` response carries.

        Raises:
            ProtocolError: the response is not a ``PARAMS`` response of this format.
        """
        sizes = response.sizes
        if response.type != ResponseType.PARAMS or len(sizes) != 4 or sizes[0] != PARAMS_FORMAT:
            raise ProtocolError(
                f"an autotune parameter change of an unknown layout ({sizes[:1]}, {len(sizes)} fields; "
                f"this rank reads format {PARAMS_FORMAT}): are the ranks running different hora versions?"
            )
        if min(sizes[1:]) < 0 or sizes[3] > MAX_STAGING_BYTES or response.process_set_id != 0:
            raise ProtocolError(f"an autotune parameter change out of range: {sizes}")
        return cls(sizes[1], sizes[2], sizes[3])

    def describe(self) -> str:
        text = f"fusion threshold {self.fusion_threshold / MIB:g} MiB, cycle time {self.cycle_time_ms:g} ms"
        return text + (f", staging {self.staging_bytes / MIB:g} MiB" if self.staging_bytes else "")


def bytes_allreduced(response: Response) -> int:
    """The payload of an allreduce (or Adasum) response, in bytes; 0 for other kinds."""
    if response.type not in (ResponseType.ALLREDUCE, ResponseType.ADASUM):
        return 0
    return sum(response.sizes) * DataType(response.dtype).storage.itemsize


class Tuner:
    """Rank 0's autotuner: scores samples and says when and how the parameters change.

    Args:
        config: the job's configuration (the autotune knobs, the starting parameters).
        fixed: the parameters that stay as they are (``FUSION``, ``CYCLE``, ``STAGING``);
            None: the ones the user set (``Config.autotune_fixed``).
        clock: seconds; injectable for tests.
        seed: seeds the optimiser's candidates.
        staging_bytes: rank 0's staging area in use; 0 when it has no shared memory
            (the staging size is then not tuned).
    """

    def __init__(
        self,
        config: Config,
        fixed: Iterable[str] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        seed: int = 0,
        staging_bytes: int = 0,
    ) -> None:
        self.rank = config.topology.rank
        self.current = Params.of(config, staging_bytes)
        if fixed is None:
            fixed = [KNOB_OF[name] for name in config.autotune_fixed if name in KNOB_OF]
        self._fixed = frozenset(fixed) | (frozenset() if staging_bytes else {STAGING})
        self._free = [name for name in (FUSION, CYCLE, STAGING) if name not in self._fixed]
        self._warmup = config.autotune_warmup_samples
        self._steps_per_sample = config.autotune_steps_per_sample
        self._max_samples = config.autotune_bayes_opt_max_samples
        self._optimizer = BayesianOptimizer(len(self._free), config.autotune_gaussian_process_noise, seed)
        self._clock = clock
        self._fixed_columns = [
            int(config.hierarchical_allreduce is not False),
            int(config.hierarchical_allgather is not False),
            0,
            int(config.cache_capacity > 0),
        ]
        self._log_path = config.autotune_log
        self._log: TextIO | None = None
        self.active = bool(self._free)
        self.samples = 0  # samples ended, warm-up included
        self.scored: list[tuple[Params, float]] = []
        self._seen: set[str] = set()
        self._opened: float | None = None  # clock time the sample under way opened
        self._steps = 0
        self._bytes = 0
        if not self.active:
            log.warning("autotune: every parameter it tunes is set by hand: nothing to tune", extra=logs.at(self.rank))

    # ----- measuring -----

    def observe(self, names: list[str], nbytes: int) -> Params | None:
        """Counts a collective rank 0 finished: its tensors' names and bytes allreduced.

        Returns:
            The parameters to switch to when this ends a sample and they change, else None.
        """
        if not self.active:
            return None
        change = None
        if not self._seen.isdisjoint(names):  # a tensor comes round again: a step ends
            self._seen.clear()
            now = self._clock()
            if self._opened is None:
                self._opened, self._steps, self._bytes = now, 0, 0
            else:
                self._steps += 1
                if self._steps >= self._steps_per_sample:
                    change = self._end_sample(self._bytes / max(now - self._opened, 1e-9))
                    self._bytes, self._steps = 0, 0
                    self._opened = None if change is not None else now
        self._seen.update(names)
        if self._opened is not None:
            self._bytes += nbytes
        return change

    def _end_sample(self, score: float) -> Params | None:
        self.samples += 1
        score = float(score)
        if self.samples <= self._warmup:
            return None
        self.scored.append((self.current, score))
        self._optimizer.observe(self._point(self.current), score)
        self._write_row(self.current, score)
        if len(self.scored) >= self._max_samples:
            self.active = False
            best, best_score = max(self.scored, key=lambda scored: scored[1])
            log.info("autotune: settled on %s (%.4g MB/s) after %d samples", best.describe(), best_score / 1e6,
                     len(self.scored), extra=logs.at(self.rank))
            self.close()
            return self._switch(best)
        # A point that rounds to parameters already scored would spend a sample on them again.
        scored = {params for params, _ in self.scored}
        return self._switch(self._params(self._optimizer.suggest(lambda point: self._params(point) not in scored)))

    def _switch(self, params: Params) -> Params | None:
        if params == self.current:
            return None
        self.current = params
        return params

    # ----- the parameter box -----

    def _point(self, params: Params) -> Array:
        """``params`` as a point of the unit cube of the free parameters."""
        coords = []
        for name in self._free:
            if name == FUSION:
                log2 = math.log2(max(params.fusion_threshold, 1))
                coords.append((log2 - MIN_FUSION_LOG2) / (MAX_FUSION_LOG2 - MIN_FUSION_LOG2))
            elif name == STAGING:
                coords.append(math.log2(max(params.staging_bytes / MIB, 1.0)) / MAX_STAGING_LOG2)
            else:
                cycle = params.cycle_time_ms
                coords.append(0.0 if cycle <= 0 else ZERO_CYCLE_SHARE + (1 - ZERO_CYCLE_SHARE) * cycle / MAX_CYCLE_MS)
        return np.clip(np.asarray(coords, dtype=np.float64), 0.0, 1.0)

    def _params(self, point: Array) -> Params:
        """The parameters at ``point`` (fixed ones as configured), rounded as they travel."""
        current = self.current
        fusion, cycle_us, staging = current.fusion_threshold, current.cycle_time_us, current.staging_bytes
        for name, u in zip(self._free, point.tolist()):
            if name == FUSION:
                exact = 2.0 ** (MIN_FUSION_LOG2 + u * (MAX_FUSION_LOG2 - MIN_FUSION_LOG2))
                fusion = max(FUSION_STEP, round(exact / FUSION_STEP) * FUSION_STEP)
            elif name == STAGING:
                staging = round(2.0 ** (u * MAX_STAGING_LOG2)) * MIB  # whole MiB, as HORA_SHM_STAGING_MB
            else:
                share = max(0.0, (u - ZERO_CYCLE_SHARE) / (1 - ZERO_CYCLE_SHARE))
                cycle_us = round(share * MAX_CYCLE_MS * 1000.0)
        return Params(fusion, cycle_us, staging)

    # ----- the log -----

    def _write_row(self, params: Params, score: float) -> None:
        if self._log_path is None:
            return
        try:
            if self._log is None:
                self._log = open(self._log_path, "w", newline="", encoding="utf-8")  # noqa: SIM115 - kept open
                csv.writer(self._log).writerow(HEADER)
            row = [*self._fixed_columns, repr(params.cycle_time_ms), repr(params.fusion_threshold / MIB),
                   repr(float(score)), repr(params.staging_bytes / MIB)]  # fmt: skip
            csv.writer(self._log).writerow(row)
            self._log.flush()
        except OSError as exc:
            log.warning("autotune: cannot write its log %s: %s", self._log_path, exc, extra=logs.at(self.rank))
            self._log_path = None

    def close(self) -> None:
        """Closes the log file (the engine's end, or the tuner settled)."""
        if self._log is not None:
            self._log.close()
            self._log = None
