"""hora on Apache Spark: ``hora.spark.run``, the counterpart of ``horovod.spark.run``.

``run(fn, args, kwargs, num_proc, ...)`` runs ``fn`` on ``num_proc`` hora ranks, one
per task of a barrier-mode Spark stage, on the active ``SparkContext``, and returns
the results in rank order (``run_elastic`` is not built yet: it raises
``NotImplementedError``). ``runner`` is the driver side, ``task`` what each Spark task
does on its executor (start one rank as a child process and wait for it), ``output``
carries the ranks' output back to the driver.

This package is launcher-side: it imports ``hora.runner`` and ``hora.transport`` and
never the rank machinery (the rank imports that when ``fn`` calls ``hvd.init()``).
PySpark is imported only when ``run`` is called.
"""

from __future__ import annotations

from hora.spark.runner import run, run_elastic

__all__ = ["run", "run_elastic"]
