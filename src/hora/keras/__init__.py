"""``import hora.keras as hvd``: Horovod's ``horovod.keras`` API.

Keras 3 *is* ``tf.keras`` on TensorFlow 2.16 and later, so this is the same module as
``hora.tensorflow.keras`` (with the same choice between Keras 3 and tf_keras through
``TF_USE_LEGACY_KERAS``). ``DistributedOptimizer`` takes Horovod's ``horovod.keras``
arguments and the extra ones of ``horovod.tensorflow.keras``.
"""

from hora.tensorflow.keras import *  # noqa: F403 - the same API
from hora.tensorflow.keras import __all__ as _all
from hora.tensorflow.keras import callbacks, elastic

__all__ = list(_all)
