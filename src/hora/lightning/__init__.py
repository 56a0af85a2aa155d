"""hora for PyTorch Lightning 2: ``Trainer(strategy="hora")``.

Importing this package registers ``HoraStrategy`` in Lightning's strategy registry
under ``"hora"``, the name ``Trainer(strategy=...)`` looks up (Lightning has no
other way to find a strategy by name). Start the script with hora's launcher, one
process per device::

    # train.py
    import lightning as L
    import hora.lightning

    trainer = L.Trainer(strategy="hora", accelerator="cpu", devices=1, max_epochs=10)
    trainer.fit(model, datamodule=data)

    # horarun -np 4 python train.py

``Trainer(strategy=hora.lightning.HoraStrategy(compression=hvd.Compression.fp16))``
passes options. ``HoraEnvironment`` is the cluster environment the strategy uses:
ranks, local ranks and hosts as ``hvd.init()`` found them, under any launcher hora
supports. ``HoraSyncBatchNorm`` is what ``Trainer(sync_batchnorm=True)`` uses under
this strategy: batch normalization over every rank's batch, with ``hora.torch.SyncBatchNorm``.
"""

from lightning.pytorch.strategies import StrategyRegistry

from hora.lightning.environment import HoraEnvironment
from hora.lightning.layer_sync import HoraSyncBatchNorm
from hora.lightning.strategy import STRATEGY_NAME, HoraStrategy

__all__ = ["STRATEGY_NAME", "HoraEnvironment", "HoraStrategy", "HoraSyncBatchNorm"]

HoraStrategy.register_strategies(StrategyRegistry)
