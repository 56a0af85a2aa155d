"""The launcher side of hora: ``horarun``, ``hora.run``, ``horarun doctor``.

``cli`` parses ``horarun``'s flags (``config_file`` reads horovodrun's YAML); ``hosts``
places ranks on hosts' slots; ``placement`` tells local hosts from remote ones and where
each host's ranks reach the launcher, after ``ssh`` probed the remote ones; ``settings``
turns flags into each rank's environment; ``job`` starts, watches and stops the ranks
(``workers`` runs one, here or over ssh under ``remote``, the supervisor on the far
host; ``lifeline`` stops the local ones if ``horarun`` dies; ``output`` forwards its
output, ``control`` carries the supervisor's status lines; ``summary`` reports a failure
root cause first, with the rank's last traceback from ``tracebacks``); ``launch`` ties them together;
``run_func`` and ``task`` run a Python function on every rank (``hora.run``);
``check_build`` is ``horarun --check-build``; ``doctor`` and ``doctor_agent`` check a
cluster. The rendezvous server lives in ``hora.transport.rendezvous_server``
(``rendezvous`` re-exports it).
"""
