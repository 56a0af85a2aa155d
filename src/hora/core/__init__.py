"""The core every binding stands on: what ``init()`` builds and how collectives are submitted.

From the bottom up: ``bootstrap`` (finding the rendezvous), ``runtime`` (the mesh, the
shared-memory domain and the engine of one ``init()``), ``process_sets``, ``ops``
(submitting collectives: local checks, naming, handles), ``api`` (Horovod's functions
that are not collectives of tensors), and ``binding``/``basics`` (the collectives written
once over a framework adapter, and Horovod's basics declared once for every binding).
The bindings reach the engine and the transports only through these modules.
"""
