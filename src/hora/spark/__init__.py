"""hora on Apache Spark: ``hora.spark.run`` and ``hora.spark.run_elastic``, Horovod's counterparts.

``run(fn, args, kwargs, num_proc, ...)`` runs ``fn`` on ``num_proc`` hora ranks, one
per task of a barrier-mode Spark stage, on the active ``SparkContext``, and returns
the results in rank order. ``runner`` is its driver side, ``task`` what each Spark task
does on its executor (start one rank as a child process and wait for it), ``output``
carries the ranks' output back to the driver.

``run_elastic(fn, ..., min_num_proc, max_num_proc, ...)`` runs an elastic training
function (``hvd.elastic.run``) on hora's elastic protocol: ``elastic`` is its driver,
``agent`` what each task of its (ordinary) stage does: it serves as a host of one slot
that starts and stops ranks on the driver's command. A lost rank or task shrinks the
job, which goes on from the last commit.

This package is launcher-side: it imports ``hora.runner`` and ``hora.transport`` and
never the rank machinery (the rank imports that when ``fn`` calls ``hvd.init()``).
PySpark is imported only when ``run`` or ``run_elastic`` is called.
"""

from __future__ import annotations

from hora.spark.elastic import run_elastic
from hora.spark.runner import run

__all__ = ["run", "run_elastic"]
