"""The launcher side of elastic training (``horarun --min-np``, ``--host-discovery-script``).

Horovod's ``horovod.runner.elastic``: the driver and its building blocks.

``driver``
    the job: worlds published in the rendezvous store, workers started and watched,
    resets, blacklisting, notifications of changed hosts (docs/elastic.md).
``settings``
    the elastic flags (horovodrun's spellings and defaults) and their validation.
``discovery``
    finding the hosts: a discovery script or fixed ``-H``/``--hostfile`` hosts; the
    current hosts, how a new discovery differs from them, and the blacklist of hosts
    whose workers failed (permanent, or for a cooldown).
``assignment``
    which rank runs on which slot of the discovered hosts, surviving hosts first.
"""
