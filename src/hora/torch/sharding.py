"""Optimizer-state and gradient sharding for DistributedOptimizer (ZeRO stages 1 and 2).

``DistributedOptimizer(..., shard_optimizer_state=1)`` (or ``True``) keeps 1/N of the
optimizer state on each of the N ranks; ``shard_optimizer_state=2`` also keeps only 1/N
of the averaged gradients. See docs/sharding.md for when to use it and what it costs.

The partition (every rank computes it from the parameters' sizes alone):

- Every trainable parameter's flat view ``p.detach().view(-1)`` of ``n`` elements is
  split as hora's reducescatter splits dimension 0: rank ``r`` owns ``n // N + (1 if r
  < n % N else 0)`` consecutive elements (``partition``). Each rank owns about 1/N of
  every parameter, so the shards are even whatever the parameters' sizes.
- Rank ``r``'s *piece* of ``p`` is ``p.detach().view(-1)[a:b]``: a view into the
  parameter's own storage, a leaf that does not require grad. The *shard optimizer* is
  ``type(optimizer)`` over this rank's pieces, one shard group per user group, with
  the user's hyperparameters copied into it before every step (so LR schedulers bound
  to the wrapper work). Stepping it updates this rank's slice of every parameter in
  place. The user's optimizer keeps its groups but never steps and holds no state.
- That holds for *elementwise* optimizers (``ELEMENTWISE``: an element's update needs only
  its own gradient and state). Any other optimizer (Adafactor's factored moments, Muon's
  orthogonalised matrices) steps *whole* parameters: each belongs to one rank, assigned
  largest first to the rank holding the fewest elements (``owners_by_size``), and its
  piece is ``p.detach()`` in the parameter's own shape; the rest of the machinery (buckets,
  reducescatter, allgather) is the same with bounds that give the owner everything. The
  shards are then as even as the parameters' sizes allow, and consolidation gathers each
  owner's entries whole.

The step, with the invariant that makes it safe:

- Stage 1: the gradients are allreduced whole (``_DistributedOptimizer``'s hooks);
  each piece's ``.grad`` is the matching view of the averaged ``p.grad``.
- Stage 2: the hooks pack the gradients of a *bucket* (consecutive parameters in
  reverse registration order, in rank 0's name order, up to ``BUCKET_BYTES``, one
  dtype) into one buffer laid out rank by rank, and start one reducescatter of it
  once every gradient of the bucket is ready; the full ``p.grad`` is released at once
  (its values are in the buffer). Each rank receives its own segment: the averaged
  gradients of its pieces, which become the pieces' ``.grad``.
- After the shard step, one allgather per bucket (the same buffer layout, in the same
  bucket order on every rank) brings every rank's updated pieces into the parameters.
- Invariant: buckets, their layout and their order depend only on rank 0's names and
  the parameters' sizes and dtypes, so every rank launches the same collectives with
  the same shapes under the same names; a rank that lacks a gradient sends zeros.
"""

from __future__ import annotations

import collections
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from hora.collectives.reduce import ADASUM, AVERAGE, MAX, SUM
from hora.compression import Compressor
from hora.core.api import allgather_object, broadcast_object, current, rank, size, synchronize
from hora.core.process_sets import ProcessSet, global_process_set
from hora.torch.allreduce_optimizer import _DistributedOptimizer, drain
from hora.torch.collectives import allgather_async, allreduce_async_, reducescatter_async
from hora.torch.dynamo import outside_compile
from hora.torch.shard_layout import Bucket, Slot, buckets, flat, owners_by_size, partition, sliced, whole
from hora.torch.wrapper import _TOO_MANY_PASSES, _ZERO_GRAD_MISUSE, WrappedOptimizer, _check_gradient

GATHER_WINDOW = 2
"""Buckets whose allgather may be in flight at once after a step."""

BUCKET_BYTES = 25 * 2**20
"""The largest bucket of gradients (stage 2) or parameters (both stages) in one collective, as DDP's default."""

ELEMENTWISE = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.ASGD,
    torch.optim.Rprop,
)  # fmt: skip
"""Optimizers whose update of an element depends only on that element's gradient and state
(and scalars): stepping them on pieces of a parameter equals stepping them on the whole.
Any other optimizer (Adafactor, Muon, a class of your own) steps whole parameters, each on
the rank that owns it (``owners_by_size``)."""

REFUSED = (torch.optim.LBFGS, torch.optim.SparseAdam)
"""Optimizers sharding cannot serve: LBFGS re-evaluates a closure over every parameter
inside its step; SparseAdam needs sparse gradients."""

_NOT_CONSOLIDATED = (
    "Optimizer state has not been consolidated on this rank. Please call `consolidate_state_dict(to={rank})` on "
    "all ranks beforehand if you meant to save the global state (with shard_optimizer_state each rank holds 1/{size} "
    "of it; sharded_state_dict() saves this rank's part without communication)."
)


def shard_stage(value: Any) -> int:
    """The ZeRO stage that ``shard_optimizer_state=value`` selects: 0 (off), 1 or 2.

    Raises:
        ValueError: anything but False/True/0/1/2.
    """
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int) and value in (0, 1, 2):
        return value
    raise ValueError(
        "shard_optimizer_state must be False or 0 (no sharding), True or 1 (stage 1: shard the optimizer state) or "
        f"2 (stage 2: shard the optimizer state and the gradients); got {value!r}"
    )


def _state_bytes(state: Any) -> int:
    return sum(v.nbytes for st in state.values() for v in st.values() if isinstance(v, torch.Tensor))


class _ShardedOptimizer(_DistributedOptimizer):
    """Stage 1: gradients allreduced whole, optimizer state sharded (see the module docstring).

    Besides ``_DistributedOptimizer``'s attributes: ``_shard_stage`` (1 or 2),
    ``shard_optimizer`` (the local optimizer over this rank's pieces; None when this
    rank owns no element), ``_slots`` (the trainable parameters, in the user's group
    order), ``_buckets`` (rank 0's reverse name order; empty on one rank).
    """

    _shard_stage = 1

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[Any] | None,
        compression: type[Compressor],
        backward_passes_per_step: int,
        op: int,
        gradient_predivide_factor: float,
        groups: int | list[list[torch.Tensor]] | None,
        process_set: ProcessSet,
    ) -> None:
        super().__init__(
            optimizer, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor,
            groups, False, process_set,
        )  # fmt: skip
        self._consolidated: dict[str, Any] | None = None
        # Elementwise optimizers step slices of every parameter; the others whole parameters
        # (see the module docstring).
        self._whole = not isinstance(optimizer, ELEMENTWISE)
        self._partition()

    def _partition(self) -> None:
        """Splits every trainable parameter over the job's ranks as it is now, and builds
        the shard optimizer over this rank's pieces (with no state) and the buckets; a
        collective when the job has more than one rank (rank 0's names order the buckets)."""
        self._parts = size() if self._active else 1
        self._me = rank() if self._active else 0
        self._slots: list[Slot] = []
        trainable = [p for group in self._optimizer.param_groups for p in group["params"] if p.requires_grad]
        owners = None if self._whole is False else owners_by_size([p.numel() for p in trainable], self._parts)
        index = 0
        shard_groups = []
        for group in self._optimizer.param_groups:
            pieces = []
            for p in group["params"]:
                if p.requires_grad:
                    if not p.is_contiguous():
                        raise ValueError(
                            f"shard_optimizer_state: parameter '{self._parameter_names[p]}' is not contiguous; "
                            "sharding splits flat views of the parameters (make it contiguous first)"
                        )
                    if owners is None:
                        bounds = partition(p.numel(), self._parts)
                        a, b = bounds[self._me]
                        piece = p.detach().view(-1)[a:b] if b > a else None
                    else:  # the whole parameter, in its own shape, on its owner
                        owner = owners[len(self._slots)]
                        bounds = whole(p.numel(), owner, self._parts)
                        piece = p.detach() if owner == self._me and p.numel() else None
                    self._slots.append(Slot(p, self._parameter_names[p], index, bounds, piece))
                    if piece is not None:
                        pieces.append(piece)
                index += 1
            shard_groups.append({**_options(group), "params": pieces})
        self.shard_optimizer = _build(self._optimizer, shard_groups)
        self._buckets: list[Bucket] = []
        if self._active and self._parts > 1:
            # Buckets follow backward's order: the slots reversed, as rank 0 orders them. An
            # elastic job's workers build their optimizer at different times (a new one while
            # the others sync), so no collective may run here: there every rank takes its own
            # order (the same program registers its parameters alike; if not, the buckets'
            # names differ and the collectives fail naming them).
            if current().config.elastic:
                order = [s.name for s in self._slots]
            else:
                order = broadcast_object([s.name for s in self._slots], root_rank=0, name="shard.order")
            position = {name: i for i, name in enumerate(order)}
            missing = [s.name for s in self._slots if s.name not in position]
            if missing:
                raise ValueError(f"shard_optimizer_state: parameters {missing} are not named on rank 0")
            ordered = sorted(self._slots, key=lambda s: position[s.name], reverse=True)
            self._buckets = buckets(ordered, self._parts, BUCKET_BYTES)

    def reshard(self, state_dict: dict[str, Any]) -> None:
        """Splits the parameters over the job's ranks as they are now and loads a full
        optimizer state into the new shards: what an elastic job does after its world
        changed (``hora.torch.elastic.TorchState`` calls it). A collective: every rank
        calls it, with the same state.

        Args:
            state_dict: a full state (``state_dict()`` after ``consolidate_state_dict``,
                or what ``gather_state_dict`` returned), from any number of ranks.
        """
        self._reset()
        self._consolidated = None
        self._partition()
        self.load_state_dict(state_dict)

    # ----- during backward -----

    def _check_dense(self, p: torch.Tensor) -> None:
        if p.grad is not None and p.grad.is_sparse:
            raise ValueError(
                f"shard_optimizer_state: parameter '{self._parameter_names[p]}' has a sparse gradient; sharding "
                "needs dense gradients (use nn.Embedding(sparse=False) or no sharding)"
            )

    def _gradient_ready(self, p: torch.Tensor) -> None:
        self._check_dense(p)
        super()._gradient_ready(p)

    # ----- step -----

    @outside_compile
    def synchronize(self) -> None:
        """Waits for every gradient's allreduce; each piece's ``.grad`` is then its view of ``p.grad``."""
        super().synchronize()
        self._attach_gradients()

    def _attach_gradients(self) -> None:
        for slot in self._slots:
            if slot.piece is None:
                continue
            grad = slot.param.grad
            if grad is not None:
                self._check_dense(slot.param)
                a, b = slot.bounds[self._me]
                slot.piece.grad = flat(grad)[a:b].reshape(slot.piece.shape)
            else:
                slot.piece.grad = None

    @outside_compile
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Waits for the gradients, steps this rank's shard, and gathers every rank's updated slices.

        With a ``closure`` (which recomputes the loss and gradients), its gradients are
        reduced before the shard steps; the closure's loss is returned.
        """
        self._synchronize_for_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if self._should_synchronize:
                self.synchronize()
                self._synchronized = False
        if self._shard_stage == 1:
            self._attach_gradients()
        self._consolidated = None  # a consolidated state is stale after a step
        # The wrapped optimizer's step hooks run around the sharded step, as around its own step.
        hooks = self._optimizer._optimizer_step_pre_hooks.values()
        for hook in list(hooks):
            hook(self._optimizer, (), {})
        if self.shard_optimizer is not None:
            for group, shard_group in zip(self._optimizer.param_groups, self.shard_optimizer.param_groups):
                shard_group.update(_options(group))
            self.shard_optimizer.step()
        self._gather_parameters()
        for hook in list(self._optimizer._optimizer_step_post_hooks.values()):
            hook(self._optimizer, (), {})
        return loss

    def _gather_parameters(self) -> None:
        """One allgather per bucket: every rank's updated slices into the parameters.

        At most ``GATHER_WINDOW`` buckets are in flight, so the gathered copies held at
        once stay a few buckets, not the whole model. Every rank launches and waits in
        the same bucket order.
        """
        in_flight: collections.deque[tuple[Bucket, int]] = collections.deque()
        for bucket in self._buckets:
            if len(in_flight) == GATHER_WINDOW:
                self._write_gathered(*in_flight.popleft())
            first = bucket.slots[0].param
            segment = torch.empty(bucket.width, dtype=first.dtype, device=first.device)
            bucket.pack(self._me, [flat(s.param.detach()) for s in bucket.slots], segment)
            in_flight.append((bucket, allgather_async(segment, name=f"shard.params.{bucket.name}")))
        while in_flight:
            self._write_gathered(*in_flight.popleft())

    def _write_gathered(self, bucket: Bucket, handle: int) -> None:
        gathered = synchronize(handle)
        with torch.no_grad():
            for r in range(self._parts):
                if r == self._me:
                    continue
                segment = gathered[r * bucket.width : (r + 1) * bucket.width]
                for slot, values in zip(bucket.slots, bucket.slices(r, segment)):
                    a, b = slot.bounds[r]
                    if b > a:
                        slot.param.detach().view(-1)[a:b].copy_(values)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clears the parameters' and the pieces' gradients.

        Raises:
            AssertionError: gradients are still being reduced (called between
                ``backward()`` and ``step()``/``synchronize()``).
        """
        super().zero_grad(set_to_none)
        if self.shard_optimizer is not None:
            self.shard_optimizer.zero_grad(set_to_none)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clips the averaged gradients by their global norm, as ``torch.nn.utils.clip_grad_norm_``.

        Each rank computes the norm of its pieces' gradients; one allreduce makes the
        global norm (every element belongs to exactly one rank). Synchronizes first if
        ``synchronize()`` has not run since the last step; then step inside
        ``skip_synchronize()``::

            loss.backward()
            optimizer.synchronize()
            optimizer.clip_grad_norm_(1.0)
            with optimizer.skip_synchronize():
                optimizer.step()

        Returns:
            The total norm of the gradients before clipping (a 0-dim float32 tensor).
        """
        if not self._synchronized:
            self.synchronize()
        grads = [s.piece.grad for s in self._slots if s.piece is not None and s.piece.grad is not None]
        norm_type = float(norm_type)
        if math.isinf(norm_type):
            local = max((float(g.abs().max()) for g in grads if g.numel()), default=0.0)
        else:
            local = sum(float(g.double().abs().pow(norm_type).sum()) for g in grads)
        total = torch.tensor([local], dtype=torch.float64)
        if self._active and self._parts > 1:
            op = MAX if math.isinf(norm_type) else SUM
            synchronize(allreduce_async_(total, name="shard.clip_grad_norm", op=op))
        norm = total[0] if math.isinf(norm_type) else total[0] ** (1.0 / norm_type)
        coef = min(float(max_norm) / (float(norm) + 1e-6), 1.0)
        if coef < 1.0:
            with torch.no_grad():
                targets = (
                    [s.param.grad for s in self._slots if s.param.grad is not None] if self._shard_stage == 1 else grads
                )
                for g in targets:
                    g.mul_(coef)
        return norm.to(torch.float32)

    # ----- state -----

    def shard_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: ``optimizer_state`` (its shard's state tensors) and
        ``gradients`` (every gradient buffer its parameters and pieces keep alive)."""
        storages: dict[int, int] = {}
        tensors = [s.param.grad for s in self._slots] + [s.piece.grad for s in self._slots if s.piece is not None]
        for g in tensors:
            if g is not None:
                storage = g.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        state = _state_bytes(self.shard_optimizer.state) if self.shard_optimizer is not None else 0
        return {"optimizer_state": state, "gradients": sum(storages.values())}

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gathers every rank's part of the optimizer state on rank ``to`` (a collective: call it on every rank).

        Afterwards ``state_dict()`` on rank ``to`` returns the state in the wrapped
        optimizer's own format (full-shape tensors, parameters numbered as the wrapped
        optimizer numbers them), loadable into an unsharded optimizer or a sharded one of
        any size. A step makes it stale: consolidate again before the next save.

        Raises:
            ValueError: ``to`` is not a rank of the job.
        """
        if not 0 <= int(to) < size():
            raise ValueError(f"consolidate_state_dict: to={to} is not a rank (the job has {size()})")
        self._consolidated = self._gather(keep=rank() == int(to))

    def holds_state(self) -> bool:
        """Whether this rank's shard has any optimizer state (none before the first step,
        unless a state was loaded)."""
        return self.shard_optimizer is not None and bool(self.shard_optimizer.state)

    def empty_state_dict(self) -> dict[str, Any]:
        """The full state of an optimizer that holds none, without communication."""
        return {"state": {}, "param_groups": self._optimizer.state_dict()["param_groups"]}

    def gather_state_dict(self) -> dict[str, Any]:
        """The full optimizer state on every rank (a collective: call it on every rank), in
        the format of ``state_dict()`` after ``consolidate_state_dict``. An elastic job's
        commit keeps it, so that a new world can be resharded from any surviving rank;
        it costs the whole state in memory on every rank while it is kept."""
        full = self._gather(keep=True)
        assert full is not None  # invariant: kept
        return full

    def _gather(self, keep: bool) -> dict[str, Any] | None:
        """Gathers every rank's slices of the state; the full state where ``keep``, else None."""
        mine = self.shard_optimizer.state if self.shard_optimizer is not None else {}
        if self._whole:
            return self._gather_whole(mine, keep)
        # Rank 0 owns a slice of every non-empty parameter, so its state names every entry:
        # [(slot number, [(key, sliced, dtype if sliced else the value)])].
        schema = [
            (k, [(key, sliced(key, v, s.piece), v.dtype if sliced(key, v, s.piece) else v) for key, v in st.items()])
            for k, s in enumerate(self._slots)
            if s.piece is not None and (st := mine.get(s.piece)) is not None
        ]
        if self._active and self._parts > 1:
            schema = broadcast_object(schema if self._me == 0 else None, root_rank=0, name="shard.consolidate")
        state: dict[int, dict[str, Any]] = {}
        for k, entries in schema:
            slot = self._slots[k]
            own = mine.get(slot.piece, {}) if slot.piece is not None else {}
            a, b = slot.bounds[self._me]
            values: dict[str, Any] = {}
            handles = []
            for key, is_sliced, info in entries:
                if not is_sliced:
                    values[key] = info.clone() if isinstance(info, torch.Tensor) else info
                    continue
                part = own.get(key)
                if part is None:
                    part = torch.zeros(b - a, dtype=info, device=slot.param.device)
                if self._parts == 1:
                    values[key] = part.detach().clone().reshape(slot.param.shape)
                else:
                    name = f"shard.state.{slot.name}.{key}"
                    handles.append((key, allgather_async(part.detach().contiguous(), name=name)))
            for key, handle in handles:
                full = synchronize(handle)
                if keep:
                    values[key] = full.reshape(slot.param.shape)
            if keep:
                state[slot.index] = {key: values[key] for key, _, _ in entries}
        return {"state": state, "param_groups": self._optimizer.state_dict()["param_groups"]} if keep else None

    def _gather_whole(self, mine: Any, keep: bool) -> dict[str, Any] | None:
        """``_gather`` for whole parameters: each owner's entries, as they are, by one
        object allgather (every rank receives them for the moment; the others drop them)."""
        owned = {
            s.index: {key: v.detach().cpu() if isinstance(v, torch.Tensor) else v for key, v in st.items()}
            for s in self._slots
            if s.piece is not None and (st := mine.get(s.piece)) is not None
        }
        everyone = allgather_object(owned, name="shard.consolidate") if self._active and self._parts > 1 else [owned]
        if not keep:
            return None
        state: dict[int, dict[str, Any]] = {}
        devices = {s.index: s.param.device for s in self._slots}
        for part in everyone:
            for index, entries in part.items():
                state[index] = {k: v.to(devices[index]) if isinstance(v, torch.Tensor) else v for k, v in entries.items()}
        return {"state": state, "param_groups": self._optimizer.state_dict()["param_groups"]}

    def state_dict(self) -> dict[str, Any]:
        """The consolidated state (on the rank ``consolidate_state_dict`` gathered it to).

        Raises:
            RuntimeError: ``consolidate_state_dict`` has not run on every rank since
                the last step, or gathered to another rank.
        """
        if self._consolidated is None:
            raise RuntimeError(_NOT_CONSOLIDATED.format(rank=self._me, size=self._parts))
        return self._consolidated

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a full optimizer state (a ``state_dict()`` after ``consolidate_state_dict``,
        or an unsharded optimizer's), keeping this rank's slice of each tensor. Every rank
        calls it with the same state; the number of ranks that saved it does not matter.

        Raises:
            ValueError: a ``sharded_state_dict()`` (use ``load_sharded_state_dict``), or
                the groups or a tensor's size do not match the parameters.
        """
        if "hora_sharded" in state_dict:
            raise ValueError(
                "load_state_dict: this is a sharded_state_dict(); load it with load_sharded_state_dict(), "
                "or save a full one with consolidate_state_dict() and state_dict()"
            )
        self._reset()
        groups = state_dict["param_groups"]
        # The user's optimizer checks the groups and takes their hyperparameters; it keeps no state.
        self._optimizer.load_state_dict({"state": {}, "param_groups": groups})
        saved_index = {}
        position = 0
        for group, saved in zip(self._optimizer.param_groups, groups):
            for _, index in zip(group["params"], saved["params"]):
                saved_index[position] = index
                position += 1
        shard_state: dict[int, dict[str, Any]] = {}
        piece_number = {id(s.piece): i for i, s in enumerate(s for s in self._slots if s.piece is not None)}
        for slot in self._slots:
            full = state_dict["state"].get(saved_index[slot.index])
            if slot.piece is None or full is None:
                continue
            a, b = slot.bounds[self._me]
            entry: dict[str, Any] = {}
            for key, value in full.items():
                if self._whole:  # the owner keeps the parameter's whole state, in its shapes
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
                elif sliced(key, value, slot.param):
                    if value.numel() != slot.param.numel():
                        raise ValueError(
                            f"load_state_dict: state '{key}' of parameter '{slot.name}' has {value.numel()} elements; "
                            f"the parameter has {slot.param.numel()}"
                        )
                    entry[key] = flat(value)[a:b].clone()
                else:
                    entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
            shard_state[piece_number[id(slot.piece)]] = entry
        self._load_shard(shard_state)

    def _load_shard(self, shard_state: dict[int, dict[str, Any]]) -> None:
        self._consolidated = None
        if self.shard_optimizer is None:
            return
        shard = self.shard_optimizer.state_dict()
        for group, shard_group in zip(self._optimizer.param_groups, shard["param_groups"]):
            shard_group.update(_options(group))
        self.shard_optimizer.state.clear()
        self.shard_optimizer.load_state_dict({"state": shard_state, "param_groups": shard["param_groups"]})

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part of the state, without communication; load it with
        ``load_sharded_state_dict`` on the same rank of a job of the same size."""
        shard = self.shard_optimizer.state_dict()["state"] if self.shard_optimizer is not None else {}
        return {
            "hora_sharded": {"world_size": self._parts, "rank": self._me, "layout": self._layout()},
            "state": shard,
            "param_groups": self._optimizer.state_dict()["param_groups"],
        }

    def load_sharded_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads what ``sharded_state_dict()`` saved on this rank.

        Raises:
            ValueError: not a sharded state, or saved by another rank, a job of another
                size or another model (load a consolidated ``state_dict()`` instead).
        """
        meta = state_dict.get("hora_sharded")
        if meta is None:
            raise ValueError(
                "load_sharded_state_dict: not a sharded_state_dict(); load a full state with load_state_dict()"
            )
        if meta["world_size"] != self._parts or meta["rank"] != self._me:
            raise ValueError(
                f"load_sharded_state_dict: saved by rank {meta['rank']} of {meta['world_size']}; this is rank "
                f"{self._me} of {self._parts}. A job of another size loads a consolidated state: "
                "consolidate_state_dict() + state_dict() when saving, load_state_dict() when loading"
            )
        if meta["layout"] != self._layout():
            raise ValueError("load_sharded_state_dict: saved for other parameters (their number or sizes differ)")
        self._reset()
        self._optimizer.load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        self._load_shard(dict(state_dict["state"]))

    def _layout(self) -> list[tuple[int, int, int]]:
        return [(s.index, *s.bounds[self._me]) for s in self._slots]

    def _broadcast_state(self, root_rank: int, process_set: ProcessSet) -> bool:
        """broadcast_optimizer_state: the consolidated state, from ``root_rank`` to every rank."""
        self.consolidate_state_dict(to=root_rank)
        full = self._consolidated if rank() == root_rank else None
        if self._active and self._parts > 1:
            full = broadcast_object(full, root_rank, name="broadcast_optimizer_state", process_set=process_set)
        assert full is not None  # invariant: root_rank kept it
        self.load_state_dict(full)
        return True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "add_param_group is not supported with shard_optimizer_state: give the optimizer all its groups "
            "before wrapping it"
        )

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self._optimizer!r}, shard_optimizer_state={self._shard_stage})"


class _Stage2Optimizer(_ShardedOptimizer):
    """Stage 2: gradients reducescattered in buckets, each rank keeping 1/N of them.

    ``_handles`` holds ``(None, None)`` for a parameter counted but not launched, and
    its bucket's ``(handle, ctx)`` once the bucket's reducescatter started (Horovod's
    meaning of the attribute). After ``synchronize()``/``step()``, ``p.grad`` is None and
    each piece's ``.grad`` holds this rank's slice of the averaged gradient.
    """

    _shard_stage = 2

    def _partition(self) -> None:
        super()._partition()
        self._bucket_of = {id(s.param): i for i, b in enumerate(self._buckets) for s in b.slots}
        self._ready = [0] * len(self._buckets)
        self._launched: dict[int, tuple[Any, Any, torch.Tensor]] = {}

    def _gradient_ready(self, p: torch.Tensor) -> None:
        _check_gradient(p)
        self._check_dense(p)
        if self._allreduce_delay[p] <= 0:
            raise AssertionError(_TOO_MANY_PASSES)
        self._allreduce_delay[p] -= 1
        self._handles[p] = (None, None)
        if self._allreduce_delay[p] == 0 and self._buckets:  # no buckets: one rank (an elastic job's)
            i = self._bucket_of[id(p)]
            self._ready[i] += 1
            if self._ready[i] == len(self._buckets[i].slots):
                self._launch_bucket(i)

    def _launch_bucket(self, i: int) -> None:
        """Packs bucket ``i``'s gradients (zeros for a missing one), releases them, starts its reducescatter."""
        bucket = self._buckets[i]
        first = bucket.slots[0].param
        buffer = torch.empty(self._parts * bucket.width, dtype=first.dtype, device=first.device)
        flats = [None if s.param.grad is None else flat(s.param.grad) for s in bucket.slots]
        for r in range(self._parts):
            bucket.pack(r, flats, buffer[r * bucket.width : (r + 1) * bucket.width])
        del flats
        for slot in bucket.slots:
            slot.param.grad = None  # its values are in the buffer
        compressed, ctx = self._compression.compress(buffer)
        prescale, postscale = self._scales()
        handle = reducescatter_async(
            compressed, name=f"shard.grads.{bucket.name}", op=self.op, prescale_factor=prescale,
            postscale_factor=postscale,
        )  # fmt: skip
        self._launched[i] = (handle, ctx, compressed)
        for slot in bucket.slots:
            self._handles[slot.param] = (handle, ctx)

    @outside_compile
    def synchronize(self) -> None:
        """Waits for every bucket's reducescatter; each piece's ``.grad`` is then this rank's
        slice of the averaged gradient, and ``p.grad`` is None.

        Buckets not launched yet (a parameter unused this step, or fewer backward
        passes than ``backward_passes_per_step``) are reduced now.
        """
        if not self._buckets:  # one rank: the local gradients are the averages
            for slot in self._slots:
                self._check_dense(slot.param)
                grad = slot.param.grad
                if slot.piece is not None:
                    slot.piece.grad = None if grad is None else grad.reshape(slot.piece.shape)
                slot.param.grad = None
            self._handles.clear()
            self._reset_delays()
            self._synchronized = True
            return
        try:
            for i in range(len(self._buckets)):  # the same order on every rank
                if i not in self._launched:
                    self._launch_bucket(i)
            for i, bucket in enumerate(self._buckets):
                handle, ctx, _ = self._launched[i]
                segment = self._compression.decompress(synchronize(handle), ctx)
                for slot, grad in zip(bucket.slots, bucket.slices(self._me, segment)):
                    if slot.piece is not None:
                        slot.piece.grad = grad.reshape(slot.piece.shape)
        finally:
            self._launched.clear()
            self._handles.clear()
            self._reset_delays()
            self._ready = [0] * len(self._buckets)
        self._synchronized = True

    def _reset(self) -> None:
        launched = [handle for handle, _, _ in self._launched.values()]
        self._launched.clear()
        self._handles.clear()
        drain(launched)
        self._synchronized = False
        self._should_synchronize = True
        self._reset_delays()
        self._ready = [0] * len(self._buckets)


def _options(group: dict[str, Any]) -> dict[str, Any]:
    """A parameter group's hyperparameters (everything but its parameters)."""
    return {k: v for k, v in group.items() if k != "params"}


def _build(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> torch.optim.Optimizer | None:
    """``type(optimizer)`` over the pieces, with the same defaults; None when this rank owns no element."""
    if not any(group["params"] for group in groups):
        return None
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    # Defaults the constructor does not take (AdamW's decoupled_weight_decay) are in every group anyway.
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    shard = cls(groups, **kwargs)
    shard.defaults = dict(optimizer.defaults)
    return shard


def sharded_optimizer(
    stage: int,
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[Any] | None,
    compression: type[Compressor],
    backward_passes_per_step: int,
    op: int,
    gradient_predivide_factor: float,
    groups: int | list[list[torch.Tensor]] | None,
    process_set: ProcessSet,
) -> WrappedOptimizer:
    """``DistributedOptimizer(..., shard_optimizer_state=stage)``, after the checks that apply to sharding.

    Raises:
        ValueError: op other than Average or Sum (Adasum included), a process set other
            than the global one, ``groups`` with stage 2, or LBFGS / SparseAdam (``REFUSED``).
    """
    if op == ADASUM:
        raise ValueError(
            "shard_optimizer_state cannot be combined with op=Adasum (Adasum combines whole weight changes); "
            "use op=Average or op=Sum, or no sharding"
        )
    if op not in (AVERAGE, SUM):
        raise ValueError(f"shard_optimizer_state needs op=Average or op=Sum; got op={op}")
    if process_set is not global_process_set:
        raise ValueError("shard_optimizer_state supports the global process set only (process_set=global_process_set)")
    if stage == 2 and groups is not None:
        raise ValueError(
            "shard_optimizer_state=2 fuses gradients in its own buckets; groups= applies to stage 1 or no sharding only"
        )
    if isinstance(optimizer, REFUSED):
        raise ValueError(
            f"shard_optimizer_state: {type(optimizer).__name__} is not supported: "
            + (
                "it re-evaluates a closure over all parameters at once in its step"
                if isinstance(optimizer, torch.optim.LBFGS)
                else "it needs sparse gradients, which sharding does not move"
            )
        )
    cls = _ShardedOptimizer if stage == 1 else _Stage2Optimizer
    sharded = cls(
        optimizer, named_parameters, compression, backward_passes_per_step, op, gradient_predivide_factor, groups,
        process_set,
    )  # fmt: skip
    if optimizer.state:  # state loaded before wrapping: shard it, and keep none in the user's optimizer
        full = optimizer.state_dict()
        optimizer.state.clear()
        sharded.load_state_dict(full)
    return sharded


