"""``hora-bench``: time hora's collectives per message size, alone or next to its peers.

Layout, from the ranks up:

* ``backends`` -- hora, torch.distributed (gloo), mpi4py and Horovod behind one small
  interface; imports only NumPy at module level.
* ``worker`` -- one rank's measuring loop, the same for every backend; also runs as a
  script by path in peers' interpreters.
* ``plan`` -- sizes (nccl-tests' ``-b -e -f``), collectives, type: what every rank runs.
* ``launch`` -- starting a backend's ranks (hora's through horarun's ``Job``; peers' as
  process groups) and collecting rank 0's results.
* ``peers`` -- which peers can run here, how each is launched, and why one is skipped.
* ``report`` and ``plot`` -- comparison tables, the JSON document, the figure.
* ``cli`` -- the ``hora-bench`` command.

See docs/benchmarking.md for the method and the columns.
"""
