"""Block-wise quantization of what a collective moves, and the quantized collectives built on it.

[Note: quantized blocks on the wire]
A quantized collective moves bytes (``uint8``), one row per rank. A row is the codes of
its elements, block by block, followed by each block's scale as the 4 bytes of an fp32:

    [codes of block 0 | codes of block 1 | ... | scale 0 | scale 1 | ...]

so one collective carries both, and a rank's row is a contiguous run of the buffer (an
all-gather concatenates rows, an all-to-all sends row r to rank r). A block is
``block`` consecutive elements of a row (the last one padded with zeros); its scale is
its largest magnitude over the format's largest code, and an element's code is its
value over the scale, rounded:

- ``"int8"``: codes in [-127, 127], one byte each (ZeRO++'s qwZ and qgZ);
- ``"int4"``: codes in [-7, 7] stored as ``code + 8`` in a nibble, two to a byte, the
  element at an even index in the low nibble;
- ``"fp8"``: ``float8_e4m3fn`` codes (largest 448), one byte each: a float's relative
  error (3 bits of mantissa) rather than int8's absolute one, better for blocks with a
  few large elements among small ones.

An element is off by at most half a step: ``scale / 2`` for the integer formats, a
relative 1/16 for fp8 (plus fp8's subnormal step near zero). A block of zeros gets scale
1 (its codes are zeros). A block holding a NaN or an infinity gets a NaN or infinite
scale, and every element of it comes back NaN or infinite: the loss scaler, which
checks the reduced gradients for non-finite values, still sees the overflow and skips
the step, as it would have without quantization. Codes are computed in fp32 whatever
the tensor's dtype, and the dequantized values are cast back to it.

Bytes per element: ``bits / 8 + 4 / block``. At the default block of 256, int8 moves
1.016 bytes an element, int4 0.516; fp32 moves 4 and bf16 2.

[Note: reductions as all-to-alls]
A reduce-scatter sums in the collective, and a sum of codes with different scales means
nothing, so a quantized reduction is an all-to-all instead (ZeRO++'s qgZ): each rank
quantizes its buffer row by row (row r is rank r's slice of the bucket), sends row r to
rank r, and sums the N rows it receives in fp32 after dequantizing them. Per rank that
sends (N-1)/N of the buffer, as the reduce-scatter did, at 1 or half a byte an element.
The sum runs in rank order, the same on every rank. Across replicas (hybrid sharding)
the all-reduce of each reduced shard becomes an all-to-all of the quantized shard,
repeated once per replica, then the same sum: each rank sends its shard to each other
replica, (R-1) shards where a ring all-reduce sends 2(R-1)/R of one, so it pays while
``R * bytes per quantized element < 2 * bytes per element`` (R <= 7 for int8 over fp32);
``quantize_collectives`` leaves the all-reduce as it is where it does not pay. Every
replica sums the same rows in the same order, so the copies stay identical.

A gathered weight is quantized once by its owner and dequantized by every rank, its own
owner included, so every rank computes with the same (dequantized) weight.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

_c10d = torch.ops._c10d_functional

SCALE_BYTES = 4
"""Each block's scale: an fp32."""


class Format(NamedTuple):
    name: str
    bits: int
    largest: float
    """The largest code's magnitude: the scale is a block's largest magnitude over this."""


FORMATS = {
    "int8": Format("int8", 8, 127.0),
    "int4": Format("int4", 4, 7.0),
    "fp8": Format("fp8", 8, 448.0),
}
"""The formats a collective can move ([Note: quantized blocks on the wire])."""

DEFAULT_BLOCK = 256
"""Elements per block (one fp32 scale each)."""


def check_block(block) -> None:
    """``block`` must be a positive multiple of 8 (two int4 codes a byte, and the scales
    after the codes aligned to their 4 bytes)."""
    if not isinstance(block, int) or isinstance(block, bool) or block < 8 or block % 8:
        raise ValueError(f"the quantization block must be a multiple of 8 elements (8 or "
                         f"more; a few hundred to a few thousand is usual), got {block!r}")


def row_bytes(numel: int, fmt: str, block: int) -> int:
    """Bytes of one quantized row of ``numel`` elements: codes, then a scale per block."""
    blocks = math.ceil(numel / block)
    return blocks * block * FORMATS[fmt].bits // 8 + blocks * SCALE_BYTES


def bytes_per_element(fmt: str, block: int) -> float:
    """What a quantized collective moves per element, its scales included."""
    return FORMATS[fmt].bits / 8 + SCALE_BYTES / block


def quantize_rows(rows: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """``rows`` (R, S), any floating dtype, as a ``uint8`` (R, ``row_bytes(S)``) buffer
    ([Note: quantized blocks on the wire])."""
    spec = FORMATS[fmt]
    count, numel = rows.shape
    blocks = math.ceil(numel / block)
    x = rows.float()
    if blocks * block != numel:
        x = torch.nn.functional.pad(x, (0, blocks * block - numel))
    x = x.view(count, blocks, block)
    scale = x.abs().amax(dim=2, keepdim=True) / spec.largest
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)  # NaN and inf stay
    scaled = x / scale
    if fmt == "fp8":
        codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        # a NaN code (an infinity over an infinite scale) is 0: the scale keeps it non-finite
        q = torch.nan_to_num(scaled.round(), nan=0.0).clamp(-spec.largest, spec.largest)
        if spec.bits == 8:
            codes = q.to(torch.int8).view(torch.uint8)
        else:
            nibbles = (q + 8).to(torch.uint8).view(count, blocks * block // 2, 2)
            codes = nibbles[..., 0] | (nibbles[..., 1] << 4)
    scale_bytes = scale.view(count, blocks).view(torch.uint8)
    return torch.cat([codes.reshape(count, -1), scale_bytes], dim=1)


def dequantize_rows(packed: torch.Tensor, numel: int, fmt: str, block: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """The (R, ``numel``) values in ``dtype`` that ``quantize_rows`` packed into ``packed``."""
    spec = FORMATS[fmt]
    count = packed.shape[0]
    blocks = math.ceil(numel / block)
    code_bytes = blocks * block * spec.bits // 8
    codes = packed[:, :code_bytes]
    scale = packed[:, code_bytes:].contiguous().view(torch.float32).view(count, blocks, 1)
    # Integer codes are multiplied by the fp32 scales as they are: the product promotes to
    # fp32 in the one kernel, so no fp32 copy of the codes exists, eager or lowered (float8
    # does not promote, so fp8 codes are converted first).
    if fmt == "fp8":
        values = codes.view(torch.float8_e4m3fn).float()
    elif spec.bits == 8:
        values = codes.view(torch.int8)
    else:
        nibbles = torch.stack([codes & 15, codes >> 4], dim=-1).view(count, -1)
        values = nibbles.view(torch.int8) - 8
    x = (values.reshape(count, blocks, block) * scale).view(count, blocks * block)
    return (x if blocks * block == numel else x[:, :numel]).to(dtype)


def quantized_all_gather(flat: torch.Tensor, *, world_size: int, group_name: str, fmt: str,
                         block: int) -> torch.Tensor:
    """What ``wait_tensor(all_gather_into_tensor(flat, world_size, group_name))`` returns,
    with every row moved quantized ([Note: quantized blocks on the wire])."""
    rows = flat.reshape(1, -1)
    packed = quantize_rows(rows, fmt, block)
    gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(packed, world_size, group_name))
    full = dequantize_rows(gathered, rows.shape[1], fmt, block, flat.dtype)
    return full.reshape(world_size * flat.shape[0], *flat.shape[1:])


def quantized_reduce_scatter(buffer: torch.Tensor, *, op: str, world_size: int,
                             group_name: str, fmt: str, block: int) -> torch.Tensor:
    """What ``wait_tensor(reduce_scatter_tensor(buffer, op, world_size, group_name))``
    returns (``op`` "sum" or "avg"), as an all-to-all of quantized rows summed in fp32
    ([Note: reductions as all-to-alls])."""
    rows = buffer.reshape(world_size, -1)
    received = _all_to_all_rows(quantize_rows(rows, fmt, block), world_size, group_name)
    return _sum_rows(received, rows.shape[1], op, fmt, block, buffer.dtype)


def quantized_all_reduce(tensor: torch.Tensor, *, op: str, group_size: int, group_name: str,
                         fmt: str, block: int) -> torch.Tensor:
    """What ``wait_tensor(all_reduce(tensor, op, group_name))`` returns on a group of
    ``group_size`` ranks: each rank's quantized tensor sent to every other, the copies
    summed in fp32 in rank order ([Note: reductions as all-to-alls])."""
    packed = quantize_rows(tensor.reshape(1, -1), fmt, block)
    received = _all_to_all_rows(packed.expand(group_size, -1).contiguous(), group_size,
                                group_name)
    return _sum_rows(received, tensor.numel(), op, fmt, block, tensor.dtype).view(tensor.shape)


def _all_to_all_rows(rows: torch.Tensor, ranks: int, group_name: str) -> torch.Tensor:
    """Row r to rank r; row r of the result from rank r."""
    splits = [1] * ranks
    return _c10d.wait_tensor(_c10d.all_to_all_single(rows, splits, splits, group_name))


def _sum_rows(received: torch.Tensor, numel: int, op: str, fmt: str, block: int,
              dtype: torch.dtype) -> torch.Tensor:
    total = dequantize_rows(received, numel, fmt, block, torch.float32).sum(dim=0)
    if op == "avg":
        total = total / received.shape[0]
    return total.to(dtype)
