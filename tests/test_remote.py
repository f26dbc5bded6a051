import torch
from torch import nn
import sys; sys.path.insert(0, "tests")
from test_inside import Enc, CNN, _graph
from somatize.torch.inside import architecture as A
from somatize.graph import as_graph
g = as_graph(Enc())
print(g.nodes(), type(g.implementation(g.nodes()[0])))
print(A.architecture(Enc(), torch.randn(3,4)))
orig = A._capture
def cap(*a):
    r = orig(*a); print("captured", {k: type(v) for k,v in r[0].items()}); return r
A._capture = cap
print(A.architecture(_graph(), torch.randn(3,4)))
