"""How a tensor is written down: safetensors, never pickle.

Registered as the codec of kind ``"torch.Tensor"`` when `somatize.torch` is imported (and imported
on its own when a store hands back bytes holding a tensor). What is kept is the dtype, the
shape and the numbers; what is not kept is where the tensor lived (it comes back on the cpu;
move it yourself, or let a graph do it), its autograd history (the tensor is detached) and
whether it was an `nn.Parameter` (it comes back a plain tensor). A 0-dim tensor stays 0-dim,
a non-contiguous view is packed first, bfloat16 and the float8 types are kept as they are.
Sparse, nested, quantized and meta tensors are refused: there are no numbers to write down,
or no plain layout to write them in; so is a dtype safetensors does not read back (packed fp4,
an MX scale, complex32).
"""

from __future__ import annotations

import functools

import safetensors
import safetensors.torch
import torch

from somatize.codecs import codec

__all__ = ["dump_tensor", "load_tensor"]


def dump_tensor(tensor: torch.Tensor) -> bytes:
    """The safetensors bytes of `tensor` (detached, packed, on the cpu).

    Refuses sparse, nested, quantized and meta tensors, and a dtype safetensors does not read
    back, with a `TypeError` that says what to do.
    """
    plain = _plain(tensor)
    if not _read_back(plain.dtype):
        raise TypeError(
            f"a {plain.dtype} tensor cannot be written down: safetensors "
            f"{safetensors.__version__} does not read that dtype back; .to() one it does "
            "(a float8, bfloat16, float32, an integer type)"
        )
    return safetensors.torch.save({"tensor": plain})


@functools.cache
def _read_back(dtype: torch.dtype) -> bool:
    """Whether safetensors writes a tensor of `dtype` and reads it back as one (it writes a
    packed fp4 and an MX scale, and then cannot read them)."""
    try:
        return (
            load_tensor(safetensors.torch.save({"tensor": torch.empty(0, dtype=dtype)})).dtype
            == dtype
        )
    except Exception:  # noqa: BLE001  (any failure is a no)
        return False


def _plain(
    tensor: torch.Tensor, cannot: str = "be written down", none: str = "write down"
) -> torch.Tensor:
    """`tensor`'s numbers as they are written down (here, and down the wire): detached, on the
    cpu, contiguous, conj and neg resolved, the tensor's own memory when it is already so.
    Refuses sparse, nested, quantized and meta tensors, saying what it `cannot` do and has
    `none` to do."""
    if tensor.is_nested:
        raise TypeError(
            f"a nested tensor cannot {cannot} as it is; .unbind() it into a list of tensors "
            "(or .to_padded_tensor(0.0))"
        )
    if tensor.layout != torch.strided:
        raise TypeError(
            f"a {tensor.layout} tensor cannot {cannot} as it is; "
            f"convert it first (for sparse: .to_dense())"
        )
    if tensor.is_quantized:
        raise TypeError(f"a quantized tensor cannot {cannot}; .dequantize() it first")
    if tensor.is_meta:
        raise TypeError(
            f"a tensor on the meta device has no numbers to {none} (it keeps only a shape): "
            "compute it on a real device, or build its model outside torch.device('meta')"
        )
    return tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()


def load_tensor(data: bytes) -> torch.Tensor:
    """The tensor that `dump_tensor` wrote, on the cpu. Refuses (`ValueError`) bytes that
    are not safetensors holding one tensor named "tensor" (safetensors itself checks that
    the header's offsets lie inside the bytes, so nothing is allocated beyond them)."""
    loaded = safetensors.torch.load(bytes(data))
    if list(loaded) != ["tensor"]:
        raise ValueError(f"safetensors bytes holding {sorted(loaded)[:4]}, not one 'tensor'")
    return loaded["tensor"]


codec("torch.Tensor", torch.Tensor, dump=dump_tensor, load=load_tensor)
