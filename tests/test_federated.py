"""fedavg, and gather across threads and across processes sharing a directory store."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from somatize import Store
from somatize.torch import fedavg, gather


def export(value: float, count: int = 1, dtype=torch.float32):
    return {
        "enc": {
            "w": torch.full((2, 2), value, dtype=dtype),
            "n": torch.tensor(count),
        }
    }


def test_fedavg_weighs_by_size_and_keeps_counts_from_the_first():
    avg = fedavg([export(1.0, 3), export(4.0, 7)], sizes=[2, 1])
    assert avg["enc"]["w"].dtype == torch.float32
    assert torch.equal(avg["enc"]["w"], torch.full((2, 2), 2.0))
    assert avg["enc"]["n"].item() == 3
    assert torch.equal(fedavg([export(1.0), export(3.0)])["enc"]["w"], torch.full((2, 2), 2.0))


def test_sizes_may_be_numpy_numbers_as_a_dataset_length_often_is(tmp_path):
    import numpy as np

    avg = fedavg([export(1.0, 3), export(4.0, 7)], sizes=np.array([2, 1]))
    assert torch.equal(avg["enc"]["w"], torch.full((2, 2), 2.0))
    assert torch.equal(
        fedavg([export(1.0), export(4.0)], sizes=[np.float32(2.0), np.int64(1)])["enc"]["w"],
        torch.full((2, 2), 2.0),
    )
    with pytest.raises(ValueError, match=r"sizes\[1\].*>= 0"):
        fedavg([export(1.0), export(4.0)], sizes=np.array([1.0, np.nan]))
    store = Store(tmp_path / "s")
    answers: dict[int, dict] = {}

    def client(k):
        size = np.int64(2) if k == 0 else np.float64(1.0)
        answers[k] = gather(
            store, export(1.0 + 3 * k), run="r", round=0, clients=2, mine=k, size=size, asking=0.02
        )

    threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k in range(2):  # weighed 2:1, as plain Python sizes are
        assert torch.equal(answers[k]["enc"]["w"], torch.full((2, 2), 2.0))
    assert type(dict(store.resolve("r/round/0/client/0").meta)["size"]) is int


def test_fedavg_averages_in_float64_and_casts_back():
    # In float16 the running sum of these would round: 2048 + 1 is 2048 there.
    exports = [export(2048.0, dtype=torch.float16)] + [export(2050.0, dtype=torch.float16)] * 3
    avg = fedavg(exports)["enc"]["w"]
    assert avg.dtype == torch.float16
    wide = (2048.0 + 3 * 2050.0) / 4
    assert torch.equal(avg, torch.full((2, 2), wide, dtype=torch.float64).to(torch.float16))


def test_fedavg_refuses_mismatches_and_bad_sizes():
    with pytest.raises(ValueError, match="no exports"):
        fedavg([])
    with pytest.raises(ValueError, match="nodes"):
        fedavg([export(1.0), {"other": {}}])
    with pytest.raises(ValueError, match="keys"):
        fedavg([export(1.0), {"enc": {"w": torch.zeros(2, 2)}}])
    with pytest.raises(ValueError, match="float32"):
        fedavg([export(1.0), {"enc": {"w": torch.zeros(3), "n": torch.tensor(1)}}])
    with pytest.raises(ValueError, match="one size per export"):
        fedavg([export(1.0), export(2.0)], sizes=[1])
    with pytest.raises(ValueError, match=">= 0"):
        fedavg([export(1.0), export(2.0)], sizes=[1, -1])
    with pytest.raises(ValueError, match="every size is 0"):
        fedavg([export(1.0), export(2.0)], sizes=[0, 0])


def test_fedavg_refuses_nan_and_inf_naming_where():
    poisoned = export(1.0)
    poisoned["enc"]["w"][0, 1] = float("nan")
    with pytest.raises(ValueError, match=r"export 1 .*node 'enc', 'w' holds 1 NaN"):
        fedavg([export(1.0), poisoned])
    blown = export(1.0)
    blown["enc"]["w"][:] = float("inf")
    with pytest.raises(ValueError, match=r"export 0 .*holds 4 NaN or infinite"):
        fedavg([blown, export(1.0)])
    with pytest.raises(ValueError, match="not a tensor"):
        fedavg([export(1.0), {"enc": {"w": [1.0, 2.0], "n": torch.tensor(1)}}])
    with pytest.raises(ValueError, match="finite number"):
        fedavg([export(1.0), export(2.0)], sizes=[1, float("inf")])


def test_fedavg_takes_opaque_exports_as_the_exports_they_wrap():
    from somatize import Opaque

    assert torch.equal(
        fedavg([Opaque(export(1.0)), export(3.0)])["enc"]["w"], torch.full((2, 2), 2.0)
    )


def test_gather_refuses_what_is_not_an_export_before_keeping_anything(tmp_path):
    store = Store(tmp_path / "s")
    poisoned = export(1.0)
    poisoned["enc"]["w"][1, 1] = float("-inf")
    for bad, said in (("weights", "is a str"), (poisoned, "infinite"), ({"enc": 1}, "entry")):
        with pytest.raises(ValueError, match=said):
            gather(store, bad, run="r", round=0, clients=2, mine=0, within=5, asking=0.01)
    assert store.names() == []


def two_good_clients(store, *, within=30.0):
    """Clients 0 and 1 gather round 0 of run "r" (of 3), one in a thread, one here: their
    answers, and the RuntimeWarnings the two of them gave."""
    import warnings

    answers, errors = {}, {}

    def client(k):
        try:
            answers[k] = gather(
                store,
                export(float(k) + 1),
                run="r",
                round=0,
                clients=3,
                mine=k,
                size=1,
                within=within,
                asking=0.02,
            )
        except Exception as error:  # noqa: BLE001  (reported by the test)
            errors[k] = error

    with warnings.catch_warnings(record=True) as caught:  # the whole process's, both clients'
        warnings.simplefilter("always")
        other = threading.Thread(target=client, args=(1,))
        other.start()
        client(0)
        other.join(timeout=2 * within)
    assert errors == {}
    return answers, [str(w.message) for w in caught if w.category is RuntimeWarning]


@pytest.mark.parametrize(
    "bad, said",
    [
        ("not an export", "is a str"),
        ({"other": {"w": torch.zeros(2, 2)}}, "holds nodes ['other']"),
        ({"enc": {"w": torch.zeros(3), "n": torch.tensor(1)}}, "torch.float32(3,)"),
        ({"enc": {"w": torch.full((2, 2), float("nan")), "n": torch.tensor(1)}}, "NaN"),
    ],
    ids=["str", "other-nodes", "other-shape", "nan"],
)
def test_a_bad_record_is_left_out_and_the_round_completes_among_the_good(tmp_path, bad, said):
    import time

    store = Store(tmp_path / "s")
    store.keep("r/round/0/client/2", bad, meta=[("size", 1)])  # written by someone else
    began = time.monotonic()
    answers, warned = two_good_clients(store)
    assert time.monotonic() - began < 20  # not `within`: nobody waited for client 2
    for k in (0, 1):
        assert torch.equal(answers[k]["enc"]["w"], torch.full((2, 2), 1.5))
    assert len(warned) == 2  # each client is told
    assert all("without 1 client" in w and "client 2: " in w and said in w for w in warned)
    meta = store.resolve("r/round/0/average")
    assert meta.get("averaged") == [0, 1] and meta.get("left_out")[0][0] == 2


def test_a_damaged_binding_or_blob_is_left_out_too(tmp_path):
    store = Store(tmp_path / "s")
    key = store.keep("r/round/0/client/2", export(9.0), meta=[("size", 1)])
    hexed = key.split(":")[1]
    (tmp_path / "s" / "blobs" / "sha256" / hexed[:2] / hexed[2:]).write_bytes(b"rot")
    answers, warned = two_good_clients(store)
    assert torch.equal(answers[0]["enc"]["w"], torch.full((2, 2), 1.5))
    assert len(warned) == 2 and "cannot be read" in warned[0] and "corrupt" in warned[0]
    other = Store(tmp_path / "t")
    other.keep("r/round/0/client/2", export(9.0))
    (tmp_path / "t" / "names" / "r" / "round" / "0" / "client" / "2" / ".bind").write_bytes(b"x")
    answers, warned = two_good_clients(other)
    assert torch.equal(answers[1]["enc"]["w"], torch.full((2, 2), 1.5))
    assert len(warned) == 2 and all("cannot be read" in w for w in warned)


def test_an_average_that_is_not_one_is_refused_at_once_naming_it(tmp_path):
    store = Store(tmp_path / "s")
    store.claim("r/round/0/averager", store.put(b"ghost"))
    store.keep("r/round/0/average", {"enc": {"w": torch.zeros(5)}})
    for k in range(3):
        store.keep(f"r/round/0/client/{k}", export(1.0), meta=[("size", 1)])
    with pytest.raises(ValueError, match=r"average of round 0 .*'r/round/0/average'.* nodes|keys"):
        gather(
            store, export(1.0), run="r", round=0, clients=3, mine=0, size=1, within=30, asking=0.01
        )


HOSTILE_ROUND = textwrap.dedent(
    """
    import sys, threading, warnings
    import msgpack, torch
    from somatize import Store
    from somatize.torch import gather

    store = Store(sys.argv[1])
    deep = msgpack.packb(None)
    for _ in range(195):  # the 900 bytes that used to kill the averager
        deep = msgpack.packb(msgpack.ExtType(1, b"\\x91" + deep))
    store.bind("r/round/0/client/2", store.put(deep))
    answers = {}

    def client(k):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            answers[k] = gather(store, {"enc": {"w": torch.full((2,), float(k))}}, run="r",
                                round=0, clients=3, mine=k, within=60, asking=0.02)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    print(answers[0]["enc"]["w"].tolist(), answers[1]["enc"]["w"].tolist())
    print(store.resolve("r/round/0/average").get("left_out"))
    """
)


def test_hostile_bytes_in_a_record_do_not_kill_the_averager(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", HOSTILE_ROUND, str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    first, left = done.stdout.splitlines()
    assert first == "[0.5, 0.5] [0.5, 0.5]"
    assert left.startswith("[[2, ") and "32 deep" in left


def test_gather_three_threads_one_averager_same_answer(tmp_path):
    store = Store(tmp_path / "s")
    answers: dict[int, dict] = {}

    def client(k):
        answers[k] = gather(
            store, export(float(k)), run="r", round=0, clients=3, mine=k, size=k + 1, asking=0.02
        )

    threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = (0 * 1 + 1 * 2 + 2 * 3) / 6
    for k in range(3):
        assert torch.allclose(answers[k]["enc"]["w"], torch.full((2, 2), expected))
    assert store.resolve("r/round/0/client/2") is not None
    assert dict(store.resolve("r/round/0/client/2").meta)["size"] == 3
    assert store.resolve("r/round/0/average") is not None


def test_a_round_is_put_in_once_a_retry_is_the_same_and_another_is_refused(tmp_path):
    store = Store(tmp_path / "s")
    kw = {"run": "r", "round": 0, "clients": 2, "asking": 0.02}
    answers: dict[int, dict] = {}

    def client(k):
        answers[k] = gather(store, export(float(k)), mine=k, size=1, **kw)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    again = gather(store, export(1.0), mine=1, size=1, **kw)  # a client that retries
    assert torch.equal(again["enc"]["w"], answers[0]["enc"]["w"])
    for other in ({"what": export(5.0), "size": 1}, {"what": export(1.0), "size": 7}):
        with pytest.raises(ValueError, match=r"'r/round/0/client/1' already holds another round"):
            gather(store, other["what"], mine=1, size=other["size"], **kw)
    kept = store.recall("r/round/0/client/1")  # still what the average was taken over
    assert torch.equal(kept["enc"]["w"], export(1.0)["enc"]["w"])
    assert dict(store.resolve("r/round/0/client/1").meta)["size"] == 1


def test_gather_times_out_naming_who_never_came(tmp_path):
    store = Store(tmp_path / "s")
    with pytest.raises(TimeoutError, match=r"client\(s\) \[0, 2\] never turned up"):
        gather(store, export(1.0), run="r", round=4, clients=3, mine=1, within=0.2, asking=0.05)
    for bad in ({"mine": 3}, {"clients": 0}, {"round": -1}, {"run": "a/b"}, {"size": -1}):
        kw = {"run": "r", "round": 0, "clients": 2, "mine": 0, **bad}
        with pytest.raises(ValueError):
            gather(store, export(1.0), **kw)


CLIENT = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from somatize import Graph, Node, Store
    from somatize.torch import Trainer, gather, parameters

    class Layer(Node, nn.Module):
        def __init__(self, i, o):
            nn.Module.__init__(self)
            self.lin = nn.Linear(i, o)
        def forward(self, x, ctx):
            return self.lin(x)

    where, mine = sys.argv[1], int(sys.argv[2])
    torch.manual_seed(100 + mine)  # every client starts somewhere else
    g = Graph.somatize(Layer(3, 4).named("a") >> Layer(4, 1).named("b"))
    t = Trainer(g, objective=nn.functional.mse_loss,
                optimizer=torch.optim.SGD(parameters(g), lr=0.1))
    gen = torch.Generator().manual_seed(mine)
    data = [(torch.randn(8, 3, generator=gen), torch.randn(8, 1, generator=gen))
            for _ in range(4)]
    store = Store(where)
    for r in range(3):
        t.fit(data)
        t.load(gather(store, t.export(), run="fed", round=r, clients=3, mine=mine,
                      size=len(data) * (mine + 1), within=60, asking=0.05))
    store.keep(f"final/{mine}", t.export())
    """
)


def _three_clients(tmp_path, name, code, *, timeout):
    """Run `code` as three client processes (argv: the shared store's path, the client's
    number), each to the end; answers the script and the store's path."""
    script = tmp_path / name
    script.write_text(code)
    where = tmp_path / "shared"
    root = str(Path(__file__).resolve().parents[1])
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(where), str(k)],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for k in range(3)
    ]
    for p in procs:
        out, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, out.decode()
    return script, where


def test_three_processes_federate_for_three_rounds_and_agree(tmp_path):
    script, where = _three_clients(tmp_path, "client.py", CLIENT, timeout=120)
    store = Store(where)
    finals = [store.recall(f"final/{k}") for k in range(3)]
    for k in (1, 2):
        for n in ("a", "b"):
            for key, v in finals[0][n].items():
                assert torch.equal(v, finals[k][n][key]), (k, n, key)
    averagers = {dict(store.resolve(f"fed/round/{r}/average").meta)["by"] for r in range(3)}
    assert averagers <= {0, 1, 2}
    assert len(store.names("fed/round/2/client")) == 3


def test_clients_of_which_some_give_no_size_are_weighed_the_same_and_each_is_told(tmp_path):
    import warnings

    store = Store(tmp_path / "s")
    answers: dict[int, dict] = {}
    sizes = [100, None, 1]

    def client(k):
        answers[k] = gather(
            store,
            export(float(k)),
            run="r",
            round=0,
            clients=3,
            mine=k,
            size=sizes[k],
            asking=0.02,
        )

    with warnings.catch_warnings(record=True) as caught:  # the whole process's, every client's
        warnings.simplefilter("always")
        threads = [threading.Thread(target=client, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for k in range(3):  # the plain mean of 0, 1 and 2, not 100:1 between 0 and 2
        assert torch.allclose(answers[k]["enc"]["w"], torch.full((2, 2), 1.0))
    said = [str(w.message) for w in caught if w.category is RuntimeWarning]
    assert len(said) == 3 and all("client(s) [1] gave no size" in m for m in said), said
    assert dict(store.resolve("r/round/0/average").meta)["unsized"] == [1]


RESNET_CLIENT = textwrap.dedent(
    """
    import sys, torch
    from torch import nn

    SIZES, ROUNDS = [48, 16, 8], 2

    class Block(nn.Module):  # torchvision's BasicBlock, small
        def __init__(self, c):
            super().__init__()
            self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(c)
            self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(c)
            self.relu = nn.ReLU()
        def forward(self, x):
            return self.relu(x + self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x))))))

    class ResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, bias=False),
                                      nn.BatchNorm2d(6), nn.ReLU())
            self.blocks = nn.Sequential(Block(6), Block(6))
            self.fc = nn.Linear(6, 4)
        def forward(self, x):
            return self.fc(self.blocks(self.stem(x)).mean((2, 3)))

    def data(k):
        gen = torch.Generator().manual_seed(100 + k)
        x = torch.randn(SIZES[k], 3, 6, 6, generator=gen, dtype=torch.float64)
        y = torch.randint(0, 4, (SIZES[k],), generator=gen)
        return [(x[i:i + 8], y[i:i + 8]) for i in range(0, SIZES[k], 8)]

    def build():
        torch.manual_seed(0)  # every client starts from the same weights
        return ResNet().double()

    if __name__ == "__main__":
        from somatize import Graph, Store
        from somatize.torch import Trainer, gather, parameters
        where, mine = sys.argv[1], int(sys.argv[2])
        store, g = Store(where), Graph.somatize(build())
        t = Trainer(g, objective=nn.functional.cross_entropy,
                    optimizer=torch.optim.SGD(parameters(g), lr=0.05, momentum=0.9))
        losses = []
        for r in range(ROUNDS):
            losses += t.fit(data(mine)).history
            t.load(gather(store, t.export(), run="fed", round=r, clients=3, mine=mine,
                          size=SIZES[mine], within=60, asking=0.05))
        losses = {"all": torch.tensor(losses, dtype=torch.float64)}
        store.keep(f"final/{mine}", {"losses": losses, **t.export()})
    """
)


def test_a_resnet_federated_over_three_processes_with_unequal_data_is_fedavg_in_plain_torch(
    tmp_path,
):
    import importlib.util

    script, where = _three_clients(tmp_path, "resnet_client.py", RESNET_CLIENT, timeout=180)
    spec = importlib.util.spec_from_file_location("resnet_client", script)
    c = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(c)
    # the same rounds by hand: local epochs, then the average of the state dicts by size
    models = [c.build() for _ in range(3)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in models]
    losses: list[list[float]] = [[], [], []]
    for _ in range(c.ROUNDS):
        for k, (m, opt) in enumerate(zip(models, opts, strict=True)):
            for x, y in c.data(k):
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(m(x), y)
                loss.backward()
                opt.step()
                losses[k].append(loss.item())
        states = [m.state_dict() for m in models]
        average = {
            key: sum(s[key] * n for s, n in zip(states, c.SIZES, strict=True)) / sum(c.SIZES)
            if v.is_floating_point()
            else v
            for key, v in states[0].items()
        }
        for m in models:
            m.load_state_dict(average)
    store = Store(where)
    for k in range(3):
        final = store.recall(f"final/{k}")
        assert final["losses"]["all"].tolist() == pytest.approx(losses[k], rel=1e-12)
        (nid,) = (n for n in final if n != "losses")
        for key, want in models[0].state_dict().items():
            got = final[nid][key]
            assert torch.allclose(got, want, rtol=0, atol=1e-12), (k, key)
