"""Horovod's PyTorch synthetic benchmark, on hora: training throughput on fixed random data.

The flags and output lines are those of Horovod's ``pytorch_synthetic_benchmark.py``.
``--model`` takes a torchvision model name when torchvision is installed (224x224
images, as in Horovod); without it, two built-in models on 32x32 images:
``cnn`` (a small convolutional net) and ``mlp25m`` (a 25.6M-parameter MLP, whose
100 MB of gradients per step make the run communication-bound).

    horarun -np 2 python examples/pytorch/synthetic_benchmark.py --model cnn
"""

from __future__ import annotations

import argparse
import os
import timeit

import numpy as np
import torch
import torch.nn.functional as F

import hora.torch as hvd

BUILT_IN = ("cnn", "mlp25m")


def build_model(name: str) -> tuple[torch.nn.Module, tuple[int, int, int]]:
    """Returns the model and the shape of one input image."""
    if name == "cnn":
        return (
            torch.nn.Sequential(
                torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                torch.nn.Conv2d(64, 128, 3, padding=1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(4),
                torch.nn.Flatten(), torch.nn.Linear(128 * 16, 512), torch.nn.ReLU(), torch.nn.Linear(512, 1000),
            ),
            (3, 32, 32),
        )  # fmt: skip
    if name == "mlp25m":
        return (
            torch.nn.Sequential(
                torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 4096), torch.nn.ReLU(),
                torch.nn.Linear(4096, 2560), torch.nn.ReLU(), torch.nn.Linear(2560, 1000),
            ),
            (3, 32, 32),
        )  # fmt: skip
    try:
        from torchvision import models  # type: ignore[import-not-found]
    except ImportError:
        raise SystemExit(
            f"--model {name}: torchvision is not installed; built-in models: {', '.join(BUILT_IN)}"
        ) from None
    return getattr(models, name)(), (3, 224, 224)


def default_model() -> str:
    try:
        import torchvision  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return "cnn"
    return "resnet50"


def main() -> None:
    parser = argparse.ArgumentParser(
        description="PyTorch Synthetic Benchmark", formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = parser.add_argument
    add("--fp16-allreduce", action="store_true", default=False, help="use fp16 compression during allreduce")
    add("--model", type=str, default=default_model(), help=f"model to benchmark (built in: {', '.join(BUILT_IN)})")
    add("--batch-size", type=int, default=32, help="input batch size")
    add("--num-warmup-batches", type=int, default=10, help="number of warm-up batches that don't count towards benchmark")
    add("--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration")
    add("--num-iters", type=int, default=10, help="number of benchmark iterations")
    add("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    add("--use-adasum", action="store_true", default=False, help="use adasum algorithm to do reduction")
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    if args.cuda:
        # hora stages CUDA tensors through host memory (no GPU data plane yet).
        torch.cuda.set_device(hvd.local_rank())

    torch.manual_seed(0)
    model, image = build_model(args.model)
    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = hvd.size() if not args.use_adasum else 1
    if args.cuda:
        model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), compression=compression,
        op=hvd.Adasum if args.use_adasum else hvd.Average,
    )  # fmt: skip
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, *image)
    target = torch.randint(0, 1000, (args.batch_size,))
    if args.cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    device = "GPU" if args.cuda else "CPU"
    log(f"Number of {device}s: {hvd.size()}")

    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    log("Running benchmark...")
    img_secs = []
    for x in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{x}: {img_sec:.1f} img/sec per {device}")
        img_secs.append(img_sec)

    img_sec_mean = float(np.mean(img_secs))
    img_sec_conf = float(1.96 * np.std(img_secs))
    log(f"Img/sec per {device}: {img_sec_mean:.1f} +-{img_sec_conf:.1f}")
    total, conf = hvd.size() * img_sec_mean, hvd.size() * img_sec_conf
    log(f"Total img/sec on {hvd.size()} {device}(s): {total:.1f} +-{conf:.1f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
