"""Elastic training with PyTorch (``horovod.torch.elastic``): ``run``, ``TorchState``,
``ElasticSampler``.

    import hora.torch as hvd

    hvd.init()
    sampler = hvd.elastic.ElasticSampler(dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=sampler, epoch=0)

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for batch_idx, (x, y) in enumerate(loader):
                ...
                state.sampler.record_batch(batch_idx, 32)
                if batch_idx % 10 == 0:
                    state.commit()
            state.sampler.set_epoch(state.epoch + 1)
            state.commit()

    train(state)

A reset re-initializes hora (``shutdown()`` then ``init()``); under horarun's elastic
driver that joins the job's next world (docs/elastic.md). As in Horovod, the sampler and
the state live in ``hora.torch.elastic.sampler`` and ``hora.torch.elastic.state``.
"""

from hora.elastic import run
from hora.torch.elastic.sampler import ElasticSampler
from hora.torch.elastic.state import TorchState

__all__ = ["ElasticSampler", "TorchState", "run"]
