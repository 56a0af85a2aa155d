"""HoraSyncBatchNorm: ``Trainer(sync_batchnorm=True)`` on hora.

Lightning's own plugin for ``sync_batchnorm=True`` converts batch normalization to
``torch.nn.SyncBatchNorm``, which needs a ``torch.distributed`` process group that
hora does not create. This plugin converts the layers to ``hora.torch.SyncBatchNorm``
instead (statistics over the whole batch of every rank), and back after training.
``HoraStrategy`` uses it in place of Lightning's.
"""

from __future__ import annotations

from lightning.pytorch.plugins.layer_sync import LayerSync
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm
from typing_extensions import override

import hora.torch as hvd


class HoraSyncBatchNorm(LayerSync):
    """Converts every batch normalization layer to ``hora.torch.SyncBatchNorm`` and back.

    The converted layer shares the original's parameters and running statistics
    (the same tensor objects), so optimizers and checkpoints see no difference.

    Args:
        process_set: the ranks whose batches are normalized together (every rank by default).
    """

    def __init__(self, process_set: hvd.ProcessSet = hvd.global_process_set) -> None:
        self._process_set = process_set
        # The class each converted layer had, to revert it.
        self._originals: dict[Module, type[_BatchNorm]] = {}

    @override
    def apply(self, model: Module) -> Module:
        """Replaces the batch normalization layers of ``model`` with hora's SyncBatchNorm.

        Args:
            model: the module (usually the LightningModule); changed in place.

        Returns:
            ``model``, or its replacement when ``model`` itself is a batch normalization layer.
        """
        if isinstance(model, _BatchNorm) and not isinstance(model, hvd.SyncBatchNorm):
            synced = hvd.SyncBatchNorm(
                model.num_features, model.eps, model.momentum, model.affine, model.track_running_stats,
                process_set=self._process_set,
            )  # fmt: skip
            _share_state(model, synced)
            self._originals[synced] = type(model)
            return synced
        for name, child in model.named_children():
            model.add_module(name, self.apply(child))
        return model

    @override
    def revert(self, model: Module) -> Module:
        """Turns the layers ``apply`` converted back into their original classes.

        Args:
            model: the module ``apply`` returned; changed in place.

        Returns:
            ``model``, or the original layer when ``model`` itself was converted.
        """
        original = self._originals.pop(model, None)
        if original is not None and isinstance(model, _BatchNorm):
            layer = original(model.num_features, model.eps, model.momentum, model.affine, model.track_running_stats)
            _share_state(model, layer)
            return layer
        for name, child in model.named_children():
            model.add_module(name, self.revert(child))
        return model


def _share_state(source: _BatchNorm, target: _BatchNorm) -> None:
    """Gives ``target`` the parameters, buffers and mode of ``source`` (the same tensors)."""
    if source.affine:
        target.weight = source.weight
        target.bias = source.bias
    if source.track_running_stats:
        target.running_mean = source.running_mean
        target.running_var = source.running_var
        target.num_batches_tracked = source.num_batches_tracked
    target.train(source.training)
