"""`shard(data)`: this rank's share of a list or a Dataset, for data-parallel training."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset, DistributedSampler, IterableDataset, Subset

from somatize.torch.training._ranks import rank_and_size

__all__ = ["shard"]


def shard(
    data: Any,
    *,
    shuffle: bool = False,
    seed: int = 0,
    drop_last: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
) -> Any:
    """This rank's share of `data`: a list of the items it takes from a list or a tuple, a
    `Subset` of a Dataset. The indices are torch's `DistributedSampler`'s, with its arguments::

        loader = DataLoader(shard(dataset), batch_size=32)   # 32 a rank
        Trainer(g, ..., parallel="ddp").fit(loader)

    Every rank gets as many items: the share is padded with items from the start (or, with
    `drop_last`, the tail that does not divide is left out), which is what keeps the ranks
    stepping together. Split before batching, so that rank r's k-th batch is its part of the
    k-th batch one process would take. `rank` and `world_size` default to the open process
    group's, else the launcher's (RANK, WORLD_SIZE), else 0 of 1: the whole of `data`, so
    the same script runs in one process too.

    Refused: anything but a list, a tuple or a map-style Dataset (an IterableDataset splits
    itself, in its `__iter__`), and a rank outside the world.
    """
    if isinstance(data, IterableDataset) or not isinstance(data, (list, tuple, Dataset)):
        raise TypeError(
            f"shard takes a list, a tuple or a map-style torch Dataset, not "
            f"{type(data).__name__}: an IterableDataset (or a generator) has to give each rank "
            "its share in its own __iter__; a DataLoader is built over shard(dataset)"
        )
    here, size = rank_and_size()
    rank = here if rank is None else rank
    world_size = size if world_size is None else world_size
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"shard(world_size={world_size!r}): a positive int")
    if type(rank) is not int or not 0 <= rank < world_size:
        raise ValueError(f"shard(rank={rank!r}): a rank of 0 to {world_size - 1}")
    sampler = DistributedSampler(
        data, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    mine = list(sampler)
    if isinstance(data, (list, tuple)):
        return [data[i] for i in mine]
    return Subset(data, mine)
