"""The estimate round on a narrower wire: its gradients and its estimate θ̃ in fewer bytes.

An ACCO update communicates twice: the estimate round (reduce-scatter ΣG̃, Peek, all-gather θ̃)
and the update round. Only the update must be exact: it stays the float32 average of every
micro-batch's gradient, in ``reduce_dtype``. The estimate only decides where the next
half-batch's gradients are computed, so it can travel narrower (``estimate_dtype``), which
shrinks its communication to αC:

* ``bfloat16`` / ``float16``: a cast (2 bytes per element);
* ``float8_e4m3fn``: 1 byte per element and one float32 scale per block of
  :data:`BLOCK` elements, which maps the block's largest magnitude to e4m3's largest value
  (448): ≈1.03 bytes per element.

Both directions shrink:

* **reduce-scatter.** Each rank encodes the N chunks of its payload; ``all_to_all_single``
  hands chunk r to rank r, which decodes the N chunks and sums them in float32 (a sum in the
  narrow format would round at every addition).
* **all-gather.** The owner of a shard sends θ̃ − θ, encoded; every rank decodes it and adds it
  to the θ it holds. The difference spends the narrow bits on the step alone: θ itself, which
  every rank has exactly, is not rounded to 8 or 16 bits.

The collectives move bytes: every backend with ``all_to_all_single`` and all-gather of
``uint8`` carries them (gloo, NCCL; :func:`backend_can_send`). What the engine keeps for them
is in :class:`~acco_hooks.engine.buffers.GroupBuffers`: a wire region of the encoded model
after the communication buffer, an encoded shard and a float32 shard for θ̃ − θ.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from acco_hooks.engine.collectives import all_gather
from acco_hooks.engine.settings import ESTIMATE_DTYPES, dtype_name

__all__ = ["BLOCK", "WIRE_FORMATS", "WireFormat", "all_gather_difference", "backend_can_send",
           "gather_encoded", "reduce_scatter_encoded"]  # fmt: skip

BLOCK = 128  # elements per float8 scale: 4 bytes of scale per 128 bytes of values (3 %)
_PIECE = BLOCK * 4096  # elements encoded or decoded at a time: bounds the temporaries
_ALIGN = 8  # every encoded run starts at a multiple of 8 bytes (float32 scales, float64 views)


class WireFormat:
    """How ``numel`` float values travel as bytes: a cast, or float8 with per-block scales.

    An encoded run of ``numel`` values is ``nbytes(numel)`` bytes: for float8 its scales
    (float32, one per block) then its values; for a float dtype the values cast to it.
    """

    __slots__ = ("name", "dtype", "scaled")

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.name = dtype_name(dtype)  # as the settings spell it: "bfloat16"
        self.scaled = dtype.itemsize == 1  # float8: the values need a scale per block

    def __repr__(self) -> str:
        return f"WireFormat({self.dtype})"

    def nbytes(self, numel: int) -> int:
        """Bytes of an encoded run of ``numel`` values, rounded up to a multiple of 8."""
        size = numel * self.dtype.itemsize
        if self.scaled:
            size += 4 * math.ceil(numel / BLOCK)
        return _ALIGN * math.ceil(size / _ALIGN)

    def encode(self, values: Tensor, out: Tensor) -> None:
        """Write ``values`` (1-D, floating) into the ``uint8`` tensor ``out``."""
        numel = values.numel()
        if not self.scaled:
            out[: numel * self.dtype.itemsize].view(self.dtype).copy_(values)
            return
        blocks = math.ceil(numel / BLOCK)
        scales = out[: 4 * blocks].view(torch.float32)
        codes = out[4 * blocks : 4 * blocks + numel].view(self.dtype)
        limit = torch.finfo(self.dtype).max
        for start in range(0, numel, _PIECE):
            piece = values[start : start + _PIECE]
            rows = _rows(piece)
            scale = rows.abs().amax(dim=1).div_(limit)
            # An all-zero block keeps scale 0; dividing it by 1 instead leaves its zeros zero.
            encoded = rows / torch.where(scale > 0, scale, 1.0).unsqueeze(1)
            codes[start : start + piece.numel()].copy_(encoded.view(-1)[: piece.numel()])
            scales[start // BLOCK : start // BLOCK + scale.numel()].copy_(scale)

    def decode(self, data: Tensor, numel: int, out: Tensor, accumulate: bool = False) -> None:
        """``out`` (``numel`` values, any float dtype) = (or ``+=``) the run in ``data``."""
        if not self.scaled:
            encoded = data[: numel * self.dtype.itemsize].view(self.dtype)
            out.add_(encoded) if accumulate else out.copy_(encoded)
            return
        blocks = math.ceil(numel / BLOCK)
        scales = data[: 4 * blocks].view(torch.float32)
        codes = data[4 * blocks : 4 * blocks + numel].view(self.dtype)
        for start in range(0, numel, _PIECE):
            piece = codes[start : start + _PIECE]
            rows = _rows(piece)
            decoded = rows * scales[start // BLOCK : start // BLOCK + rows.shape[0]].unsqueeze(1)
            target = out[start : start + piece.numel()]
            decoded = decoded.view(-1)[: piece.numel()]
            target.add_(decoded) if accumulate else target.copy_(decoded)



# Every format an estimate round may travel in, built once: the engine looks them up by name.
WIRE_FORMATS: dict[str, WireFormat] = {
    name: WireFormat(dtype) for name, dtype in ESTIMATE_DTYPES.items()
}

def _rows(piece: Tensor) -> Tensor:
    """``piece`` in float32 as rows of ``BLOCK``, the last one padded with zeros. Read only:
    it may be ``piece`` itself."""
    piece = piece.float()
    missing = -piece.numel() % BLOCK
    if missing:
        piece = torch.nn.functional.pad(piece, (0, missing))
    return piece.view(-1, BLOCK)


def backend_can_send(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group``'s backend runs the byte collectives of a float8 estimate."""
    if group is None:  # one process: nothing is sent
        return True
    return str(dist.get_backend(group)) in ("gloo", "nccl")


def reduce_scatter_encoded(
    shard_sum: Tensor, payload: Tensor, wire: WireFormat, send: Tensor, received: Tensor,
    group: dist.ProcessGroup | None,
) -> None:  # fmt: skip
    """``shard_sum`` (S values) = this rank's chunk of Σ over ranks of ``payload`` (N·S), each
    rank's chunk sent in ``wire`` and summed in ``shard_sum``'s dtype.

    ``send`` and ``received`` are ``uint8`` buffers of at least N·``wire.nbytes(S)`` bytes.
    """
    shard = shard_sum.numel()
    n = 1 if group is None else dist.get_world_size(group)
    run = wire.nbytes(shard)
    for r in range(n):
        wire.encode(payload[r * shard : (r + 1) * shard], send[r * run : (r + 1) * run])
    if group is None:
        received[:run].copy_(send[:run])
    else:
        dist.all_to_all_single(received[: n * run], send[: n * run], group=group)
    for r in range(n):  # in rank order on every rank: the same sum wherever it is computed
        wire.decode(received[r * run : (r + 1) * run], shard, shard_sum, accumulate=r > 0)


def all_gather_difference(
    gathered: Tensor, difference: Tensor, wire: WireFormat, send: Tensor, received: Tensor,
    group: dist.ProcessGroup | None,
) -> None:  # fmt: skip
    """``gathered`` (N·S values) = every rank's ``difference`` (S), sent in ``wire``.

    ``send`` (``wire.nbytes(S)`` bytes) receives this rank's encoded shard. (A checkpoint
    taken while the estimate is pending keeps each rank's range of the decoded ``gathered``.)
    """
    shard = difference.numel()
    run = wire.nbytes(shard)
    wire.encode(difference, send[:run])
    gather_encoded(gathered, shard, wire, send, received, group)


def gather_encoded(
    gathered: Tensor, shard: int, wire: WireFormat, send: Tensor, received: Tensor,
    group: dist.ProcessGroup | None,
) -> None:  # fmt: skip
    """The all-gather and decoding of :func:`all_gather_difference`, from the encoded shard."""
    n = 1 if group is None else dist.get_world_size(group)
    run = wire.nbytes(shard)
    if group is None:
        received[:run].copy_(send[:run])
    else:
        all_gather(received[: n * run], send[:run], group)
    for r in range(n):
        wire.decode(received[r * run : (r + 1) * run], shard, gathered[r * shard : (r + 1) * shard])
