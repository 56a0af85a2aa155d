"""Horovod's framework-free modules under their Horovod names (``horovod.common``).

Programs written for Horovod import a few names from ``horovod.common`` directly (``from
horovod.common.exceptions import HorovodInternalError`` in elastic training code, most
often); with ``horovod`` changed to ``hora`` these lines work unchanged. Each module here
re-exports hora's own objects: ``exceptions`` (``hora.errors``), ``process_sets``
(``hora.core``'s process sets) and ``elastic`` (``hora.elastic``).
"""
