"""safetensors files read without a memory map: each header checked against its file (`read_header`), a
directory's tensors through its index or its one file (`tensor_index`), and a tensor read into the memory it
belongs in with positioned reads (`read_tensor`), so that loading a model (hf.py, checkpoint.py) keeps no
pages of the file in the process's RSS and a truncated or corrupt file is one error naming it.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

INDEX_FILE, SINGLE_FILE = "model.safetensors.index.json", "model.safetensors"
_DTYPES = {
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit on a header


class CheckpointError(ValueError):
    """A Hugging Face checkpoint directory that cannot be loaded as it is; the message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offsets in the file
    end: int


def read_header(file: str) -> dict[str, TensorInfo]:
    """The tensors a safetensors file holds, from its header alone, each checked to lie inside the file.
    Raises CheckpointError naming the file when it is truncated or corrupt."""

    def corrupt(why: str) -> CheckpointError:
        return CheckpointError(
            f"{file} is not a readable safetensors file ({why}); it is truncated or corrupt: download or copy it again"
        )

    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise corrupt("shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise corrupt(f"header length {n} does not fit the file's {size} bytes")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: download or copy it again") from None
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise corrupt(f"its header is not JSON: {e}") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = _DTYPES[entry["dtype"]], tuple(int(s) for s in entry["shape"]), entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"tensor {name!r} has a malformed entry {entry!r}") from None
        nbytes = math.prod(shape) * dtype.itemsize
        if not (0 <= a <= b and b - a == nbytes):
            raise corrupt(f"tensor {name!r} spans bytes {a}..{b}, not the {nbytes} its shape {list(shape)} needs")
        if 8 + n + b > size:
            raise corrupt(f"tensor {name!r} ends at byte {8 + n + b}, past the end of the file ({size} bytes)")
        out[name] = TensorInfo(file, dtype, shape, 8 + n + a, 8 + n + b)
    return out


def read_tensor(info: TensorInfo, out: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor's bytes read from its file (positioned reads) into `out` (contiguous, same dtype and shape)
    or a new tensor."""
    if out is None:
        out = torch.empty(info.shape, dtype=info.dtype)
    view = out.view(-1).view(torch.uint8).numpy()
    with open(info.file, "rb", buffering=0) as f:
        done, total = 0, info.end - info.start
        while done < total:
            got = os.preadv(f.fileno(), [view[done:]], info.start + done)
            if got <= 0:
                raise CheckpointError(
                    f"{info.file} ended while reading a tensor: it is truncated, download or copy it again"
                )
            done += got
    return out


def tensor_index(path: str) -> dict[str, TensorInfo]:
    """Every tensor of the directory's weights (sharded with an index, or one model.safetensors), headers
    checked; the index's claims checked against the shards."""
    index_file, single = os.path.join(path, INDEX_FILE), os.path.join(path, SINGLE_FILE)
    if os.path.isfile(index_file):
        try:
            with open(index_file) as f:
                weight_map = json.load(f)["weight_map"]
            assert isinstance(weight_map, dict)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise CheckpointError(
                f"{index_file} is not a safetensors index (a JSON object with a "
                "'weight_map'); download or copy it again"
            ) from None
        shards: dict[str, dict[str, TensorInfo]] = {}
        for shard in sorted(set(weight_map.values())):
            shard_file = os.path.join(path, shard)
            if not os.path.isfile(shard_file):
                raise CheckpointError(f"{shard_file}, named in {INDEX_FILE}, is missing: download or copy it again")
            shards[shard] = read_header(shard_file)
        out = {}
        for name, shard in weight_map.items():
            if name not in shards[shard]:
                raise CheckpointError(
                    f"{os.path.join(path, shard)} lacks tensor {name!r} that {INDEX_FILE} puts "
                    "there: the index and the shards come from different checkpoints"
                )
            out[name] = shards[shard][name]
        return out
    if os.path.isfile(single):
        return read_header(single)
    raise CheckpointError(f"{path!r} has a config.json but no weights ({SINGLE_FILE} or {INDEX_FILE})")
