"""The launcher side of hora: ``horarun``, ``hora.run`` and the rendezvous server.

``cli`` parses ``horarun``'s flags; ``hosts`` places ranks on hosts' slots;
``settings`` turns flags into each rank's environment; ``job`` starts, watches and
stops the ranks (``workers`` runs one, ``output`` forwards its output, ``summary``
reports a failure root cause first); ``launch`` ties them together; ``run_func`` and
``task`` run a Python function on every rank (``hora.run``); ``rendezvous`` is the
job's authenticated key-value server.
"""
