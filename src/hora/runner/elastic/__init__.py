"""The launcher side of elastic training (``horarun --min-np``, ``--host-discovery-script``).

This package holds the pure building blocks of horarun's elastic driver, Horovod's
``horovod.runner.elastic``:

``settings``
    the elastic flags (horovodrun's spellings and defaults) and their validation.
``discovery``
    finding the hosts: a discovery script or fixed ``-H``/``--hostfile`` hosts; the
    current hosts, how a new discovery differs from them, and the blacklist of hosts
    whose workers failed (permanent, or for a cooldown).
``assignment``
    which rank runs on which slot of the discovered hosts, surviving hosts first.

The driver loop is not built yet: nothing here starts workers, polls discovery,
notifies ranks of host changes, records worker results, or re-runs the rendezvous,
and ``horarun`` still refuses the elastic flags.
"""
