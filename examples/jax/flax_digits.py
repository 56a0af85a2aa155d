"""Data-parallel training of a small Flax MLP on scikit-learn's digits, with hora.jax.

A single-process Flax + optax script plus the Horovod lines (marked "hora:"): each rank
trains on its own shard of the training set, DistributedOptimizer averages the gradient
pytree inside the jitted step, rank 0's initial parameters are broadcast, and the test
accuracy is summed over the ranks' shards of the test set. Rank 0 prints progress.

    horarun -np 2 python examples/jax/flax_digits.py
"""

from __future__ import annotations

import argparse
import os
from typing import Any

# hora: one XLA compute thread per rank, so the ranks on a machine do not oversubscribe its
# cores (set before JAX starts; docs/jax.md).
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1")

import flax.linen as nn  # noqa: E402 - after XLA_FLAGS
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

import hora.jax as hvd  # noqa: E402


class MLP(nn.Module):
    """64 pixels -> 128 -> 64 -> 10 classes."""

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.relu(nn.Dense(128)(x))
        x = nn.relu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=1e-3, help="per rank; scaled by the number of ranks")
    args = parser.parse_args()

    hvd.init()  # hora:

    digits = load_digits()
    x = (digits.images.reshape(len(digits.images), -1) / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, digits.target, test_size=0.25, random_state=0, stratify=digits.target)
    # hora: each rank keeps every size()-th example, of the training and of the test set.
    x_shard, y_shard = x_train[hvd.rank() :: hvd.size()], y_train[hvd.rank() :: hvd.size()]
    x_test_shard, y_test_shard = x_test[hvd.rank() :: hvd.size()], y_test[hvd.rank() :: hvd.size()]

    model = MLP()
    params = model.init(jax.random.PRNGKey(hvd.rank()), x_shard[:1])  # different on each rank...
    params = hvd.broadcast_parameters(params, root_rank=0)  # hora: ...until rank 0's are broadcast
    tx = hvd.DistributedOptimizer(optax.adam(args.lr * hvd.size()))  # hora: average gradients; lr * size()
    opt_state = tx.init(params)

    def loss_fn(params: Any, xb: jax.Array, yb: jax.Array) -> jax.Array:
        logits = model.apply(params, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    @jax.jit
    def step(params: Any, opt_state: Any, xb: jax.Array, yb: jax.Array) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, params)  # the allreduce runs here, inside jit
        return optax.apply_updates(params, updates), opt_state, loss

    @jax.jit
    def correct(params: Any, xb: jax.Array, yb: jax.Array) -> jax.Array:
        return jnp.sum(jnp.argmax(model.apply(params, xb), axis=-1) == yb)

    # The same number of steps on every rank (shards differ by at most one example).
    steps = len(x_train) // hvd.size() // args.batch_size
    accuracy = 0.0
    for epoch in range(1, args.epochs + 1):
        order = np.random.default_rng(1000 * epoch + hvd.rank()).permutation(len(x_shard))
        total_loss = 0.0
        for s in range(steps):
            batch = order[s * args.batch_size : (s + 1) * args.batch_size]
            params, opt_state, loss = step(params, opt_state, x_shard[batch], y_shard[batch])
            total_loss += float(loss)
        # hora: average the loss and sum the test counts over the ranks.
        loss_avg = float(hvd.allreduce(jnp.asarray(total_loss / steps), name="loss"))
        counts = hvd.allreduce(
            jnp.stack([correct(params, x_test_shard, y_test_shard), jnp.asarray(len(y_test_shard))]),
            op=hvd.Sum,
            name="counts",
        )
        accuracy = int(counts[0]) / int(counts[1])
        if hvd.rank() == 0:
            print(f"epoch {epoch:2d}  loss {loss_avg:.4f}  test accuracy {accuracy:.3f}", flush=True)
    if hvd.rank() == 0:
        print(f"final test accuracy {accuracy:.3f} on {hvd.size()} ranks")
    hvd.shutdown()


if __name__ == "__main__":
    main()
