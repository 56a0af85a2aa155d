"""HoraStrategy: data-parallel Lightning training on hora, ``Trainer(strategy="hora")``.

Lightning 1.x had a ``HorovodStrategy``; it went away with Horovod's builds for current
PyTorch. This strategy does the same job on hora, with Lightning 2's strategy hooks:

* The launcher (``horarun -np N python train.py``, or any launcher ``hvd.init()``
  understands) starts the ranks; Lightning spawns nothing (``HoraEnvironment``).
* The model is not wrapped. Every optimizer ``configure_optimizers`` returns is wrapped
  in hora's ``DistributedOptimizer``, whose hooks start each gradient's allreduce
  while backward still runs; ``accumulate_grad_batches`` becomes its
  ``backward_passes_per_step``, so accumulating batches communicate nothing.
* Gradients are synchronized right after the closure's backward, before Lightning's
  ``on_before_optimizer_step`` and gradient clipping, so both see averaged gradients;
  the step itself then runs under ``skip_synchronize()``.
* Rank 0's model (parameters and buffers) and optimizer state reach every rank at
  set-up; Lightning's ``DistributedSampler`` gives each rank its shard of each epoch.
* ``reduce`` (``self.log(..., sync_dist=True)``), ``all_gather``, ``broadcast`` and
  ``barrier`` are hora's collectives; checkpoints are written by rank 0 alone.
* ``Trainer(sync_batchnorm=True)`` normalizes with ``hora.torch.SyncBatchNorm``.
* ``teardown`` removes the gradient hooks and hands Lightning back the optimizers
  ``configure_optimizers`` returned (and the batch normalization layers).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.layer_sync import TorchSyncBatchNorm
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.strategies.strategy import TBroadcast
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.rank_zero import rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

import hora.torch as hvd
from hora.compression import Compression, Compressor
from hora.lightning.environment import HoraEnvironment
from hora.lightning.layer_sync import HoraSyncBatchNorm
from hora.torch.wrapper import WrappedOptimizer

STRATEGY_NAME = "hora"
"""The name ``Trainer(strategy=...)`` accepts once ``hora.lightning`` is imported."""

# Lightning's names for reductions (``self.log(reduce_fx=...)`` passes the function's name).
_OPS_BY_NAME = {
    "mean": hvd.Average,
    "avg": hvd.Average,
    "sum": hvd.Sum,
    "max": hvd.Max,
    "min": hvd.Min,
    "product": hvd.Product,
    "prod": hvd.Product,
}


class HoraStrategy(ParallelStrategy):
    """Data-parallel training with hora: one process per device, started by hora's launcher.

    ``Trainer(strategy="hora", accelerator="cpu", devices=1)`` after ``import
    hora.lightning``, or ``Trainer(strategy=HoraStrategy(...))``, in a script started
    with ``horarun -np N``. Each rank trains on its shard of every global batch, so the
    global batch is ``N`` times the DataLoader's ``batch_size``. Unlike Lightning 1.x's
    ``HorovodStrategy``, the learning rate is not multiplied by the number of ranks:
    scale it in ``configure_optimizers`` (``self.trainer.world_size``) if you want to.

    Args:
        accelerator: the accelerator (usually chosen by the Trainer's ``accelerator``).
        parallel_devices: the devices Lightning found (usually left to the Trainer);
            each rank uses one: the CPU, or the GPU of its local rank.
        cluster_environment: where the ranks come from; a ``HoraEnvironment`` by default.
        checkpoint_io: how checkpoints are written (Lightning's default: ``torch.save``).
        precision_plugin: the precision plugin (usually chosen by the Trainer's ``precision``).
        compression: compression of the gradients' allreduces (``hvd.Compression.none``
            or ``hvd.Compression.fp16``).
        op: how gradients are combined: ``hvd.Average`` (the default) or ``hvd.Sum``.
        gradient_predivide_factor: with ``hvd.Average``, divide gradients by this before
            the sum and by ``size / factor`` after (Horovod's meaning).
        sparse_as_dense: reduce sparse gradients as dense tensors.

    Raises:
        ValueError: ``op`` is neither ``hvd.Average`` nor ``hvd.Sum``.
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        compression: type[Compressor] = Compression.none,
        op: int = hvd.Average,
        gradient_predivide_factor: float = 1.0,
        sparse_as_dense: bool = False,
    ) -> None:
        if op not in (hvd.Average, hvd.Sum):
            # Adasum combines weight changes inside its own step, which the synchronize-then-clip
            # order this strategy relies on does not fit.
            raise ValueError(f"HoraStrategy: op must be hvd.Average or hvd.Sum (got {op!r})")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            # The launcher has started every rank; the environment starts hora and reads them.
            cluster_environment=cluster_environment if cluster_environment is not None else HoraEnvironment(),
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._compression = compression
        self._op = op
        self._gradient_predivide_factor = gradient_predivide_factor
        self._sparse_as_dense = sparse_as_dense
        # (wrapper, what configure_optimizers returned) for the optimizers this strategy wrapped.
        self._wrapped: list[tuple[WrappedOptimizer, Optimizer]] = []
        self._failed = False
        self._layers_synced = False

    # ----- where this rank runs -----

    @property
    def is_distributed(self) -> bool:
        """Always True: Lightning then adds its DistributedSampler and honours ``sync_dist``."""
        return True

    @property
    @override
    def root_device(self) -> torch.device:
        """This rank's device: the CPU, or for GPUs the one of its local rank (Horovod's rule)."""
        devices = self.parallel_devices or [torch.device("cpu")]
        device = devices[0]
        if device.type == "cuda":
            return torch.device("cuda", self.local_rank)
        return device

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """What Lightning's DistributedSampler is built with: one replica per rank."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def set_world_ranks(self) -> None:
        """Makes Lightning's rank-zero-only output (and logging) follow hora's rank; called by the Trainer."""
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def setup_environment(self) -> None:
        """Checks the environment, then sets up the device (hora itself is started by the environment).

        Raises:
            ValueError: Lightning was given more than one device for this process.
        """
        assert self.cluster_environment is not None
        self.cluster_environment.validate_settings(len(self.parallel_devices or [None]), 1)
        super().setup_environment()

    # ----- set-up and teardown -----

    @override
    def setup(self, trainer: Trainer) -> None:
        """Moves the model to this rank's device, broadcasts rank 0's, and wraps the optimizers.

        Args:
            trainer: the Trainer being set up.
        """
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        self._failed = False  # a strategy object may serve several Trainer runs
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync is not None:
            if isinstance(self._layer_sync, TorchSyncBatchNorm):
                # sync_batchnorm=True: torch's SyncBatchNorm needs torch.distributed; hora's does not.
                self._layer_sync = HoraSyncBatchNorm()
            self.model = self._layer_sync.apply(self.model)
            self._layers_synced = True
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.model = self._setup_model(self.model)
        lightning_module = self.lightning_module
        assert lightning_module is not None
        # Every rank starts from rank 0's weights and buffers (also to evaluate or predict);
        # a module's extra state that is not a tensor is left to the module.
        state = {key: value for key, value in lightning_module.state_dict().items() if isinstance(value, Tensor)}
        hvd.broadcast_parameters(state, root_rank=0)
        if fitting:
            self.setup_optimizers(trainer)
            self.optimizers = self._wrap_optimizers(self.optimizers, lightning_module, trainer.accumulate_grad_batches)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _wrap_optimizers(
        self, optimizers: list[Optimizer], module: Module, accumulate_grad_batches: int
    ) -> list[Optimizer]:
        """Each optimizer as a DistributedOptimizer, after making its state rank 0's.

        An optimizer that already is a DistributedOptimizer is kept (wrapping twice
        would reduce every gradient twice); only its backward passes per step change.
        """
        wrapped: list[Optimizer] = []
        for index, optimizer in enumerate(optimizers):
            if isinstance(optimizer, WrappedOptimizer):
                optimizer.set_backward_passes_per_step(accumulate_grad_batches)
                _broadcast_optimizer(optimizer)
                wrapped.append(optimizer)
                continue
            _broadcast_optimizer(optimizer)
            distributed = hvd.DistributedOptimizer(
                optimizer,
                named_parameters=_named_parameters(module, optimizer, index),
                compression=self._compression,
                backward_passes_per_step=accumulate_grad_batches,
                op=self._op,
                gradient_predivide_factor=self._gradient_predivide_factor,
                sparse_as_dense=self._sparse_as_dense,
            )
            self._wrapped.append((distributed, optimizer))
            wrapped.append(distributed)
        return wrapped

    @override
    def model_to_device(self) -> None:
        """Moves the model to this rank's device."""
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Follows ``accumulate_grad_batches`` when a GradientAccumulationScheduler changes it.

        Args:
            batch: the batch (unused).
            batch_idx: its index in the epoch (unused).
        """
        module = self.lightning_module
        if module is None or module._trainer is None:
            return
        passes = module.trainer.accumulate_grad_batches
        for optimizer in self._distributed_optimizers():
            # Changed only between accumulation windows (the scheduler changes it at an epoch's
            # start), when no gradient is in flight.
            if optimizer.backward_passes_per_step != passes and not optimizer._handles:
                optimizer.set_backward_passes_per_step(passes)

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Notes the failure, so ``teardown`` does not wait for ranks that may never come.

        Args:
            exception: what interrupted the Trainer.
        """
        self._failed = True

    @override
    def teardown(self) -> None:
        """Removes the gradient hooks, gives back the original optimizers and layers, waits for every rank.

        The optimizers ``configure_optimizers`` returned replace the wrappers (their
        state is the wrappers' state: they share it), so the module's parameters no
        longer start allreduces in backward after training.
        """
        if self._wrapped:
            originals = {id(wrapper): original for wrapper, original in self._wrapped}
            for wrapper, _ in self._wrapped:
                for handle in wrapper._hooks:
                    handle.remove()
                wrapper._hooks.clear()
            self.optimizers = [originals.get(id(opt), opt) for opt in self.optimizers]
            self._wrapped = []
        if self._layers_synced and self._layer_sync is not None and self.model is not None:
            self.model = self._layer_sync.revert(self.model)
            self._layers_synced = False
        if not self._failed and hvd.is_initialized():
            # Every rank has finished before any returns to the script (Lightning 1.x's
            # HorovodStrategy joined here); after a failure the others may never arrive.
            hvd.barrier()
        super().teardown()

    # ----- training -----

    def _distributed_optimizers(self) -> list[WrappedOptimizer]:
        return [opt for opt in self.optimizers if isinstance(opt, WrappedOptimizer)]

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        """With manual optimization, waits for the gradients' allreduces after each ``manual_backward``.

        Manual optimization may clip or inspect gradients, or call ``zero_grad``,
        before ``step()``; synchronizing here makes all of these see averaged
        gradients. (Automatic optimization synchronizes in ``optimizer_step``.)

        Args:
            closure_loss: the loss backward ran on (unused).
        """
        module = self.lightning_module
        if module is not None and not module.automatic_optimization:
            for optimizer in self._distributed_optimizers():
                optimizer.synchronize()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Steps the optimizer on averaged gradients, synchronized before clipping.

        The closure (training step and backward) runs first; then this waits for the
        gradients' allreduces, so the precision plugin's ``on_before_optimizer_step``
        and gradient clipping see the averaged gradients; the wrapped optimizer steps
        without synchronizing again.

        Args:
            optimizer: the optimizer to step (a DistributedOptimizer when this strategy wrapped it).
            closure: runs the training step and backward.
            model: the LightningModule.
            **kwargs: passed to ``optimizer.step``.

        Returns:
            What ``optimizer.step`` returns (usually the closure's loss).
        """
        if not isinstance(optimizer, WrappedOptimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        module = self.lightning_module
        automatic = module is None or module.automatic_optimization

        def synchronized_closure() -> Any:
            result = closure()
            # Automatic optimization: the closure's backward started the allreduces (or,
            # with fewer passes than accumulate_grad_batches at an epoch's end, left them
            # for synchronize to start). Manual: post_backward synchronized already,
            # unless backward ran outside manual_backward.
            if automatic or optimizer._handles:
                optimizer.synchronize()
            return result

        with optimizer.skip_synchronize():
            return super().optimizer_step(optimizer, synchronized_closure, model, **kwargs)

    # ----- collectives -----

    @override
    def reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        """Reduces a tensor over the ranks (what ``self.log(..., sync_dist=True)`` calls).

        Args:
            tensor: the value; anything but a tensor is returned unchanged.
            group: None for every rank, or a ``hvd.ProcessSet``.
            reduce_op: ``"mean"``/``"avg"`` (or None), ``"sum"``, ``"max"``, ``"min"``,
                ``"product"``, or ``torch.distributed.ReduceOp`` of these.

        Returns:
            The reduced tensor (a new one), the same on every rank. The mean of an
            integer tensor is returned as a floating-point tensor.

        Raises:
            ValueError: an unknown ``reduce_op``, or a ``group`` that is not a ProcessSet.
        """
        if not isinstance(tensor, Tensor):
            return tensor
        op = _hora_op(reduce_op)
        process_set = _process_set(group)
        if op == hvd.Average and not (tensor.is_floating_point() or tensor.is_complex()):
            # An average of integers is not an integer: sum, then divide.
            total = hvd.allreduce(tensor, op=hvd.Sum, process_set=process_set)
            return total / (process_set.size() or 1)
        return hvd.allreduce(tensor, op=op, process_set=process_set)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Every rank's tensor, stacked in rank order: shape ``(world_size, *tensor.shape)``.

        Args:
            tensor: this rank's tensor; every rank's must have the same shape.
            group: None for every rank, or a ``hvd.ProcessSet``.
            sync_grads: let gradients flow back through the gather (to each rank's own part).

        Returns:
            The stacked tensor, the same on every rank.

        Raises:
            ValueError: ``group`` is not a ProcessSet.
        """
        process_set = _process_set(group)
        piece = tensor.unsqueeze(0)
        if not sync_grads:
            piece = piece.detach()
        return hvd.allgather(piece, process_set=process_set)

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        """Rank ``src``'s object, on every rank (any picklable object).

        Args:
            obj: the object (only rank ``src``'s is used).
            src: the rank that sends it.

        Returns:
            Rank ``src``'s object.
        """
        result: TBroadcast = hvd.broadcast_object(obj, root_rank=src)
        return result

    @override
    def barrier(self, name: str | None = None) -> None:
        """Returns once every rank has called it.

        Args:
            name: accepted for Lightning's interface; hora's barrier needs none.
        """
        hvd.barrier()

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Nothing to block: while gradients accumulate, the DistributedOptimizer's hooks count
        backward passes and start allreduces only on the last one."""
        yield None

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Registers ``"hora"`` in Lightning's strategy registry (again: replaces it).

        Args:
            strategy_registry: Lightning's ``StrategyRegistry``.
        """
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="data-parallel training on hora (Horovod's API): one process per device, started by horarun",
            override=True,
        )


def _hora_op(reduce_op: ReduceOp | str | None) -> int:
    """hora's reduce op for Lightning's name or ``torch.distributed.ReduceOp``.

    Raises:
        ValueError: an op hora does not have (or an unknown name).
    """
    if reduce_op is None:
        return int(hvd.Average)
    if isinstance(reduce_op, str):
        op = _OPS_BY_NAME.get(reduce_op.lower())
        if op is None:
            raise ValueError(f"HoraStrategy.reduce: unknown reduce_op {reduce_op!r}; use one of {sorted(_OPS_BY_NAME)}")
        return int(op)
    for name in ("SUM", "AVG", "MAX", "MIN", "PRODUCT"):
        if hasattr(ReduceOp, name) and reduce_op == getattr(ReduceOp, name):
            return int(_OPS_BY_NAME[name.lower()])
    raise ValueError(f"HoraStrategy.reduce: unsupported reduce_op {reduce_op!r}")


def _process_set(group: Any | None) -> hvd.ProcessSet:
    """The process set a Lightning ``group`` names: None is every rank.

    Raises:
        ValueError: ``group`` is neither None nor a ``hvd.ProcessSet``.
    """
    if group is None:
        return hvd.global_process_set
    if isinstance(group, hvd.ProcessSet):
        return group
    raise ValueError(
        f"HoraStrategy: group must be None (every rank) or a hora.torch.ProcessSet, not {type(group).__name__} "
        "(torch.distributed groups do not exist under hora)"
    )


def _named_parameters(module: Module, optimizer: Optimizer, index: int) -> list[tuple[str, Tensor]]:
    """The optimizer's parameters with the module's names for them, as DistributedOptimizer takes them.

    Each gradient's collective is named after its parameter, so names must be the same
    on every rank; a parameter the module does not own is named by its place in the
    optimizer.
    """
    names = {id(p): name for name, p in module.named_parameters()}
    return [
        (names.get(id(p), f"optimizer{index}.group{g}.param{j}"), p)
        for g, group in enumerate(optimizer.param_groups)
        for j, p in enumerate(group["params"])
    ]


def _broadcast_optimizer(optimizer: Optimizer) -> None:
    """Makes this rank's optimizer state and options rank 0's.

    A fresh optimizer has no state: then only the options of its parameter groups
    (``lr``, ``momentum``, ...) are broadcast, and the state stays empty. Horovod's
    ``broadcast_optimizer_state`` would first take a step on zero gradients to create
    the state, which counts as a step for optimizers such as Adam (bias correction),
    so training would no longer match a single process. With state on rank 0
    (an optimizer built from a loaded state), all of it is broadcast.
    """
    root_has_state = hvd.broadcast_object(bool(optimizer.state_dict()["state"]), root_rank=0)
    if root_has_state:
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        return
    options = hvd.broadcast_object(
        [{key: value for key, value in group.items() if key != "params"} for group in optimizer.param_groups],
        root_rank=0,
    )
    for group, root_options in zip(optimizer.param_groups, options):
        group.update(root_options)
    optimizer.state.clear()
