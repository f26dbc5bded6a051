"""A cached forward that fails names the node it failed in, as an uncached one does, and
leaves the store and the graph as they were."""

from __future__ import annotations

import os
import shutil
import threading

import pytest
import torch
from _nodes import Add, Same
from torch import nn

import somatize.torch  # noqa: F401  (tensor codec)
from somatize import Graph, NoCodec, Node, Store
from somatize.torch import freeze


def files_of(store: Store) -> dict[str, bytes]:
    """Every file under the store's directory, by path, with its bytes."""
    found = {}
    for folder, _, names in os.walk(store.where):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as file:
                found[os.path.relpath(path, store.where)] = file.read()
    return found


def refused(g: Graph, x, store: Store, kind: type[BaseException]) -> BaseException:
    """The error `g.forward(x, store=store)` raises, having checked that it left every file
    of the store as it was."""
    before = files_of(store)
    with pytest.raises(kind) as caught:
        g.forward(x, store=store)
    assert files_of(store) == before
    return caught.value


class Moody(Node, nn.Module):
    """A linear layer whose `state_dict` fails while `broken` is set."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(2, 2)
        self.broken = False

    def state_dict(self, *args, **kwargs):
        if self.broken:
            raise RuntimeError("the weights are on a device that went away")
        return super().state_dict(*args, **kwargs)

    def forward(self, input, ctx):
        return self.lin(input)


def test_a_frozen_node_whose_state_cannot_be_read_is_named(store):
    moody = Moody()
    g = Graph.somatize(Add(0) >> moody.frozen().cached().on("cpu"))
    freeze(g)
    moody.broken = True
    error = refused(g, torch.zeros(2), store, RuntimeError)
    assert "went away" in str(error)
    assert error.__notes__ == ["while running node 'moody' (Moody), placed .on('cpu')"]
    moody.broken = False  # the graph is as it was: it runs, and keeps, once the state reads
    out = g.forward(torch.zeros(2), store=store)
    assert torch.equal(out, moody.lin(torch.zeros(2)))
    assert len(store.names("cache")) == 1


class Boom(Node):
    """Asks its input for a label."""

    def forward(self, input, ctx):
        return input["label"]


def test_a_cached_node_that_raises_is_named_as_uncached(store):
    g = Graph.somatize(Same() >> Boom().on("cpu").cached())
    notes = []
    for kept in (None, store):
        with pytest.raises(KeyError) as caught:
            g.forward({}, store=kept)
        notes.append(caught.value.__notes__)
    assert notes[0] == notes[1] == ["while running node 'boom' (Boom), placed .on('cpu')"]
    assert store.names() == []


class Lookup(Node):
    """Adds the sum of a module it is handed (its state is in its key)."""

    def __init__(self, table: nn.Module) -> None:
        self.table = table

    def forward(self, input, ctx):
        return input + sum(float(b.to_dense().sum()) for b in self.table.buffers())


def test_an_argument_whose_state_cannot_be_read_is_named(store):
    table = nn.Module()
    table.register_buffer("rows", torch.eye(3).to_sparse())  # read when keyed, not when built
    g = Graph.somatize(Add(1) >> Lookup(table).cached())
    error = refused(g, 1.0, store, TypeError)
    assert "'rows'" in str(error) and ".to_dense()" in str(error)
    assert error.__notes__ == ["while running node 'lookup' (Lookup)"]


class Lock(Node):
    """Hands back what no codec writes down."""

    def forward(self, input, ctx):
        return threading.Lock()


def test_an_output_no_codec_writes_is_named_and_nothing_is_kept(store):
    g = Graph.somatize(Add(1) >> Lock().cached())
    error = refused(g, 1, store, NoCodec)
    assert error.__notes__ == ["while running node 'lock' (Lock)"]


class Some(Node):
    """Hands each item back, but a lock for the item 3."""

    def forward(self, input, ctx):
        return [threading.Lock() if v == 3 else v for v in input]


def test_a_mapped_node_keeps_none_of_its_items_when_one_cannot_be_kept(store):
    g = Graph.somatize(Some().mapped().cached())
    error = refused(g, [1, 2, 3, 4], store, NoCodec)
    assert error.__notes__ == ["while running node 'some' (Some)"]
    assert g.forward([1, 2], store=store) == [1, 2]
    assert len(store.names("cache")) == 2


def test_a_store_that_can_no_longer_be_written_is_named(store):
    g = Graph.somatize(Add(1) >> Add(2).cached())
    assert g.forward(1, store=store) == 4
    for folder in ("blobs", "names"):  # a file where each folder was: nothing can be written
        shutil.rmtree(os.path.join(store.where, folder))
        with open(os.path.join(store.where, folder), "wb"):
            pass
    error = refused(g, 5, store, OSError)
    assert error.__notes__ == ["while running node 'add_2' (Add)"]


def test_a_kept_value_whose_bytes_are_not_a_value_is_computed_again(store):
    g = Graph.somatize(Add(1) >> Add(2).cached())
    assert g.forward(1, store=store) == 4
    [bound] = store.bound("cache")
    store.bind(bound.name, store.put(b"\xc1 not an encoded value"), meta=bound.meta)
    said = []
    with pytest.warns(RuntimeWarning, match="node 'add_2'.*cannot be read back"):
        assert g.forward(1, store=store, watching=said.append) == 4
    assert [f["cache"] for f in said if f.get("node") == "add_2"] == ["miss"]
    assert store.recall(bound.name) == 4  # kept anew: the store is repaired


@pytest.mark.parametrize("folder", ["blobs", "names"])
def test_a_kept_value_damaged_on_disk_is_named_and_computed_again(store, folder):
    g = Graph.somatize(Add(1) >> Add(2).cached())
    assert g.forward(1, store=store) == 4
    for name, data in files_of(store).items():  # the value's bytes, or the name's binding
        if name.startswith(folder):
            with open(os.path.join(store.where, name), "wb") as file:
                file.write(data[: len(data) // 2])
    with pytest.warns(RuntimeWarning, match="node 'add_2'.*cannot be read back"):
        assert g.forward(1, store=store) == 4
    assert [b.name for b in store.bound()] == store.names()  # every binding reads again
    assert store.recall(store.names("cache")[0]) == 4


class Held(Node):
    """Hands its input on; holds `t`."""

    def __init__(self, t) -> None:
        self.t = t

    def forward(self, input, ctx):
        return input


def test_an_argument_its_codec_refuses_is_refused_naming_the_node_unless_salted(store):
    sparse = torch.eye(2).to_sparse()
    with pytest.raises(ValueError, match="node 'held' is .cached.*argument 't'.*sparse.*salt"):
        Graph.somatize(Held(sparse).cached())
    with pytest.raises(ValueError, match="argument 't' of node 'held', which feeds it.*sparse"):
        Graph.somatize(Held(sparse) >> Add(1).cached())
    g = Graph.somatize(Held(sparse).cached(salt="eye"))
    assert g.forward(1, store=store) == g.forward(1, store=store) == 1
    assert len(store.names("cache")) == 1


def test_a_node_no_cached_node_reads_runs_as_uncached_even_if_its_state_cannot_be_read(store):
    after, beside = Moody(), Moody()
    g = Graph()
    g.node("add", Add(0).cached())
    g.node("after", after.frozen())  # downstream of the cached node
    g.node("beside", beside.frozen())  # on another branch
    g.edge("add", "after")
    freeze(g)
    after.broken = beside.broken = True
    x = torch.ones(2)
    plain = g.forward(x)
    said = []
    for cache in ("miss", "hit"):
        out = g.forward(x, store=store, watching=said.append)
        assert out.keys() == plain.keys() and all(torch.equal(out[n], plain[n]) for n in out)
        ran = [f for f in said if f["fact"] == "ran"]
        assert [f.get("cache") for f in ran if f["node"] == "add"] == [cache]
        said.clear()
    assert len(store.names("cache")) == 1


class Masked(Node, nn.Module):
    """A linear layer beside a sparse buffer."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(2, 2)
        self.register_buffer("mask", torch.eye(2).to_sparse())

    def forward(self, input, ctx):
        return self.lin(input)


def test_a_frozen_node_with_a_sparse_buffer_is_named_saying_what_to_do(store):
    g = Graph.somatize(Masked().frozen().cached())
    freeze(g)
    x = torch.ones(2)
    g.forward(x)  # uncached, it runs
    error = refused(g, x, store, TypeError)
    assert "'mask'" in str(error) and "sparse" in str(error) and ".to_dense()" in str(error)
    assert error.__notes__ == ["while running node 'masked' (Masked)"]


def test_an_argument_made_unreadable_after_building_is_refused_when_keyed_unless_salted(store):
    box = {"t": torch.eye(2)}  # readable when built, then changed where no key can read it
    cached = Graph.somatize(Held(box).cached())
    feeding = Graph.somatize(Held(box) >> Add(1).cached())
    salted = Graph.somatize(Held(box) >> Add(1).cached(salt="v1"))
    for unreadable in (torch.eye(2).to_sparse(), threading.Lock()):
        box["t"] = unreadable
        error = refused(cached, 1, store, ValueError)
        assert "node 'held' is .cached()" in str(error) and "argument \"t['t']\"" in str(error)
        assert "salt=" in str(error) and error.__notes__ == ["while running node 'held' (Held)"]
        error = refused(feeding, 1, store, ValueError)
        assert "node 'add' is .cached()" in str(error) and "node 'held', which feeds" in str(error)
        assert salted.forward(1, store=store) == 2  # the salt stands for what no key reads
    box["t"] = torch.eye(2)  # readable again: the refusals left nothing in the way
    assert cached.forward(1, store=store) == feeding.forward(1, store=store) - 1 == 1
    assert len(store.names("cache")) == 3
