"""Code written against the published reference pages (`somatize.torch` and the core), run as
written there, in the ways a researcher's own code reaches them: each test is a call the pages
document, made with what users' data and models really look like."""

from __future__ import annotations

import copy
from collections import namedtuple

import torch
from torch import nn
from torch.nn.functional import cross_entropy
from torch.optim import SGD
from torch.utils.data import DataLoader, Dataset

from somatize import Graph, Node, Opaque
from somatize.torch import Trainer, parameters


class Encoder(Node, nn.Module):
    """Eight features to sixteen."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU())

    def forward(self, input, ctx):
        return self.net(input)


class Head(Node, nn.Module):
    """Sixteen features to three classes."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.lin = nn.Linear(16, 3)

    def forward(self, input, ctx):
        return self.lin(input)


Sample = namedtuple("Sample", "image label")


class Samples(Dataset):
    """A dataset whose items are namedtuples, as many are written: DataLoader's default collate
    keeps the namedtuple, so each batch is a `Sample` of two tensors."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(24, 8, generator=gen)
        self.y = torch.randint(0, 3, (24,), generator=gen)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> Sample:
        return Sample(self.x[i], self.y[i])


def test_fit_takes_a_batch_that_is_a_namedtuple_of_input_and_target_as_the_pair_it_is():
    torch.manual_seed(0)
    enc, head = Encoder(), Head()
    twins = copy.deepcopy(enc), copy.deepcopy(head)
    loader = DataLoader(Samples(), batch_size=8)
    assert isinstance(next(iter(loader)), Sample)

    g = Graph.somatize(enc >> head)
    t = Trainer(g, objective=cross_entropy, optimizer=SGD(parameters(g), lr=0.1))
    named = t.fit(loader, epochs=2).history
    # the same batches as plain (input, target) tuples, on a twin of the same weights
    g2 = Graph.somatize(twins[0] >> twins[1])
    t2 = Trainer(g2, objective=cross_entropy, optimizer=SGD(parameters(g2), lr=0.1))
    plain = t2.fit([tuple(b) for b in loader], epochs=2).history
    assert named == plain and len(named) == 6
    # an Opaque in a namedtuple batch is taken off as in a tuple's
    x, y = next(iter(loader))
    assert t.step(Sample(Opaque(x), Opaque(y))) == t2.step((x, y))


def test_probe_leaves_no_hook_behind_on_a_convnext_s_layer_scale_it_read():
    # "Deterministic, and side-effect free; the net is left as it was": a ConvNeXt layer reads
    # its layer_scale parameter directly (param * x), so the probe hears that parameter's
    # gradient; afterwards nothing of the probe may stay on it. A hook left there would run
    # in every later backward of training and, under grasp's second-order backward, turn a
    # gradient that asks for its own gradient into a number (torch warns of that)
    import warnings

    from models import zoo

    from somatize.torch import probe, proxies

    torch.manual_seed(0)
    case = zoo.convnext()
    g = Graph.somatize(case.model)
    first = probe(g, case.example)
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        scores = proxies(g, case.example, target=case.target, objective=case.objective)
    assert [str(w.message) for w in heard if "requires_grad" in str(w.message)] == []
    assert "grasp" in scores
    assert probe(g, case.example) == first  # and a second probe reads what the first did


def test_auditing_given_the_audit_class_instead_of_one_is_refused_saying_to_build_one():
    # the page writes auditing=Audit(every=10, channels=True); the class itself, a slip of
    # two brackets, is refused as any other unusable auditing= is, saying what to pass
    import pytest

    from somatize.torch import Audit

    g = Graph.somatize(Encoder() >> Head())
    with pytest.raises(ValueError, match=r"class Audit.*Audit\(\)"):
        Trainer(g, objective=cross_entropy, optimizer=SGD(parameters(g), lr=0.1), auditing=Audit)


def test_an_objective_or_a_watcher_given_as_a_class_is_refused_saying_to_build_one(tmp_path):
    # Trainer(g, objective=cross_entropy, ...) as the page writes it, with the module form of
    # the loss, nn.CrossEntropyLoss, missing its brackets; and watching=Recorder, the class
    # and not one over a store. Each is refused where it is given, naming the class and what
    # to pass, not at the first step inside torch or the store
    import pytest

    from somatize import Recorder

    g = Graph.somatize(Encoder() >> Head())
    with pytest.raises(TypeError, match=r"class CrossEntropyLoss: build one, CrossEntropyLoss\("):
        Trainer(g, objective=nn.CrossEntropyLoss, optimizer=SGD(parameters(g), lr=0.1))
    with pytest.raises(TypeError, match=r"class Recorder.*Recorder\(\.\.\.\)"):
        Trainer(g, objective=cross_entropy, optimizer=SGD(parameters(g), lr=0.1), watching=Recorder)
    with pytest.raises(TypeError, match=r"class Recorder"):
        g.forward(torch.randn(2, 8), watching=[Recorder])
    # built, each works
    t = Trainer(
        g,
        objective=nn.CrossEntropyLoss(),
        optimizer=SGD(parameters(g), lr=0.1),
        watching=Recorder(tmp_path, run="r"),
    )
    assert t.step((torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))) > 0


def test_gradient_takes_an_opaque_envelope_or_a_map_of_them_as_it_takes_the_bare_ones():
    # gradient(value) reads what an envelope carries; published code wraps what crosses an
    # edge in Opaque, and an Opaque is taken off at every entry point
    from somatize.torch import envelope, gradient

    a, b = torch.ones(2, 3), torch.full((2, 3), 2.0)
    assert torch.equal(gradient(Opaque(envelope(a))), a)
    assert torch.equal(gradient({"left": Opaque(envelope(a)), "right": envelope(b)}), a + b)
    assert gradient(Opaque(envelope(None))) is None and gradient(Opaque(a)) is None
