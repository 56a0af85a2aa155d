"""hora.torch inside ``torch.compile``: collectives, their gradients and a whole
compiled training step with ``DistributedOptimizer``.

TorchDynamo traces what a compiled function calls and compiles every frame beneath it;
before ``hora.torch.dynamo`` it traced into hora's engine (run by the calling thread) and
the engine failed on every rank. Each collective is now a graph break and runs eagerly.
"""

from __future__ import annotations

import pytest

from harness import run_ranks

pytestmark = pytest.mark.ranks


def compiled_job() -> list[str]:
    import torch

    import hora.torch as hvd

    hvd.init()
    me, n = hvd.rank(), hvd.size()
    problems: list[str] = []

    @torch.compile
    def summed(t: torch.Tensor) -> torch.Tensor:
        return hvd.allreduce(t * 2, op=hvd.Sum) + 1

    for call in range(2):  # the second call runs the compiled code
        got = summed(torch.ones(4) * (me + 1))
        if got.tolist() != [2.0 * n * (n + 1) / 2 + 1] * 4:
            problems.append(f"allreduce call {call}: {got.tolist()}")

    # Horovod's gradient of a Sum: the summed upstream gradients, through the compiled code.
    x = torch.ones(3, requires_grad=True)

    @torch.compile
    def loss_of(x: torch.Tensor) -> torch.Tensor:
        return (hvd.allreduce(x * (me + 1), op=hvd.Sum) ** 2).sum()

    loss_of(x).backward()
    total = n * (n + 1) / 2  # y = total * x, dloss/dy = 2 y on every rank
    want = 2 * total * n * (me + 1)
    if x.grad is None or x.grad.tolist() != [want] * 3:
        problems.append(f"gradient: {None if x.grad is None else x.grad.tolist()}, want {want}")

    # A compiled step: forward, backward and the optimizer's step (its hooks and synchronize).
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    before = model.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())

    @torch.compile
    def step(batch: torch.Tensor) -> torch.Tensor:
        opt.zero_grad()
        loss = model(batch).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    for _ in range(3):
        step(torch.full((8, 4), float(me + 1)))
    weights = hvd.allgather_object(model.weight.detach().clone())
    if not all(torch.equal(weights[0], w) for w in weights):
        problems.append(f"weights differ across ranks: {weights}")
    if torch.equal(weights[0], before):
        problems.append("the compiled steps did not train")
    hvd.shutdown()
    return problems


@pytest.mark.timeout(240)
def test_collectives_and_a_training_step_inside_torch_compile() -> None:
    for rank, problems in enumerate(run_ranks(2, compiled_job, timeout=200)):
        assert problems == [], f"rank {rank}: {problems}"
