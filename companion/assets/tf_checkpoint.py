"""Read TensorFlow checkpoints (V2 "tensor bundles") without TensorFlow.

A checkpoint ``<prefix>`` is two or more files:

* ``<prefix>.index``: an SSTable (LevelDB's table format, as TensorFlow's
  ``tensorflow/core/lib/io/table``) mapping each tensor name to a serialised
  ``BundleEntryProto`` (dtype, shape, shard, offset, size, masked CRC32C);
  the empty key holds a ``BundleHeaderProto`` (number of shards, endianness);
* ``<prefix>.data-<shard>-of-<num_shards>``: the raw little-endian tensor bytes.

``<prefix>.meta`` (the graph) is not needed. This module decodes both the
table and the two protobuf messages with the standard library and numpy.

Format facts used here (table): a 48-byte footer = two block handles (varint64
offset and size each, zero-padded to 40 bytes) + the magic number
0xdb4775248b80fb57 (little-endian); each block is followed by a 1-byte
compression type (0 = none, the only one TensorFlow's bundle writer uses; others
are refused) and a masked CRC32C; block entries are prefix-compressed
(shared, non-shared, value lengths as varint32) with a restart array at the end.
"""
from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .manifest import AssetError

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48

#: tensorflow/core/framework/types.proto -> numpy (little endian)
DTYPES = {
    1: np.dtype("<f4"), 2: np.dtype("<f8"), 3: np.dtype("<i4"), 4: np.dtype("u1"), 5: np.dtype("<i2"),
    6: np.dtype("i1"), 9: np.dtype("<i8"), 10: np.dtype("?"), 17: np.dtype("<u2"), 19: np.dtype("<f2"),
    22: np.dtype("<u4"), 23: np.dtype("<u8"),
}
DTYPE_NAMES = {7: "string", 8: "complex64", 14: "bfloat16", 18: "complex128", 20: "resource", 21: "variant"}


class CheckpointFormatError(AssetError):
    """The files are not a readable TensorFlow V2 checkpoint."""


# --------------------------------------------------------------------------- CRC32C

def _crc_table() -> list[int]:
    poly = 0x82F63B78  # Castagnoli, reflected
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def _crc32c_python(data: bytes) -> int:
    crc = 0xFFFFFFFF
    table = _TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _fast_crc32c():
    try:
        import google_crc32c

        return lambda data: google_crc32c.value(bytes(data))
    except ImportError:
        pass
    try:
        import crc32c as _c

        return lambda data: _c.crc32c(data)
    except ImportError:
        return None


FAST_CRC32C = _fast_crc32c()


def crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli) of ``data``; uses google-crc32c or crc32c when installed."""
    return FAST_CRC32C(data) if FAST_CRC32C is not None else _crc32c_python(data)


def unmask_crc(masked: int) -> int:
    """Inverse of LevelDB/TensorFlow's ``crc32c::Mask``."""
    rot = (masked - 0xA282EAD8) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


# --------------------------------------------------------------------------- protobuf

def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise CheckpointFormatError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 70:
            raise CheckpointFormatError("varint too long")


def _fields(buf: bytes):
    """Yield (field number, wire type, value) of a serialised protobuf message."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            val, pos = _varint(buf, pos)
        elif wt == 1:
            val = struct.unpack_from("<Q", buf, pos)[0]
            pos += 8
        elif wt == 2:
            n, pos = _varint(buf, pos)
            val = buf[pos:pos + n]
            pos += n
        elif wt == 5:
            val = struct.unpack_from("<I", buf, pos)[0]
            pos += 4
        else:
            raise CheckpointFormatError(f"unsupported protobuf wire type {wt}")
        yield num, wt, val


def _signed64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


@dataclass(frozen=True)
class BundleEntry:
    """One tensor of the index: where its bytes are and what they are."""

    name: str
    dtype: int
    shape: tuple[int, ...]
    shard_id: int
    offset: int
    size: int
    crc32c: int | None  # unmasked; None when absent
    sliced: bool = False

    @property
    def numpy_dtype(self) -> np.dtype:
        if self.dtype not in DTYPES:
            kind = DTYPE_NAMES.get(self.dtype, f"DataType {self.dtype}")
            raise CheckpointFormatError(f"{self.name}: tensors of type {kind} are not supported")
        return DTYPES[self.dtype]


def _parse_shape(buf: bytes) -> tuple[int, ...]:
    dims = []
    for num, _, val in _fields(buf):
        if num == 2:  # repeated Dim dim
            size = 0
            for n2, _, v2 in _fields(val):
                if n2 == 1:
                    size = _signed64(v2)
            dims.append(size)
        elif num == 3 and val:
            raise CheckpointFormatError("tensor of unknown rank")
    return tuple(dims)


def _parse_entry(name: str, buf: bytes) -> BundleEntry:
    f = {"dtype": 0, "shape": (), "shard_id": 0, "offset": 0, "size": 0, "crc32c": None, "sliced": False}
    for num, _, val in _fields(buf):
        if num == 1:
            f["dtype"] = val
        elif num == 2:
            f["shape"] = _parse_shape(val)
        elif num == 3:
            f["shard_id"] = val
        elif num == 4:
            f["offset"] = _signed64(val)
        elif num == 5:
            f["size"] = _signed64(val)
        elif num == 6:
            f["crc32c"] = unmask_crc(val)
        elif num == 7:
            f["sliced"] = True
    return BundleEntry(name=name, **f)


# --------------------------------------------------------------------------- SSTable

def _read_block(data: bytes, offset: int, size: int, where: str) -> bytes:
    end = offset + size
    if end + 5 > len(data):
        raise CheckpointFormatError(f"{where}: block beyond the end of the file")
    block, ctype = data[offset:end], data[end]
    stored = struct.unpack_from("<I", data, end + 1)[0]
    if crc32c(block + bytes([ctype])) != unmask_crc(stored):
        raise CheckpointFormatError(f"{where}: block checksum mismatch (file corrupt or truncated)")
    if ctype != 0:  # TensorFlow's BundleWriter writes its index uncompressed
        raise CheckpointFormatError(f"{where}: compressed table blocks (type {ctype}) are not supported")
    return block


def _block_entries(block: bytes):
    if len(block) < 4:
        raise CheckpointFormatError("block too short")
    n_restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
    end = len(block) - 4 * (n_restarts + 1)
    pos, key = 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        non_shared, pos = _varint(block, pos)
        vlen, pos = _varint(block, pos)
        key = key[:shared] + block[pos:pos + non_shared]
        pos += non_shared
        yield key, block[pos:pos + vlen]
        pos += vlen


def read_sstable(path: str | os.PathLike) -> dict[bytes, bytes]:
    """All key/value pairs of a LevelDB-format table file."""
    data = Path(path).read_bytes()
    if len(data) < FOOTER_SIZE:
        raise CheckpointFormatError(f"{path}: too short to be a checkpoint index")
    footer = data[-FOOTER_SIZE:]
    magic = struct.unpack_from("<Q", footer, 40)[0]
    if magic != TABLE_MAGIC:
        raise CheckpointFormatError(f"{path}: not a TensorFlow checkpoint index (bad magic number)")
    pos = 0
    _, pos = _varint(footer, pos)  # metaindex handle (unused: no filters in bundles)
    _, pos = _varint(footer, pos)
    idx_off, pos = _varint(footer, pos)
    idx_size, pos = _varint(footer, pos)
    out: dict[bytes, bytes] = {}
    for _, handle in _block_entries(_read_block(data, idx_off, idx_size, f"{path} (index block)")):
        off, p = _varint(handle, 0)
        size, _ = _varint(handle, p)
        for k, v in _block_entries(_read_block(data, off, size, f"{path} (data block)")):
            out[k] = v
    return out


# --------------------------------------------------------------------------- checkpoints

def resolve_checkpoint_prefix(path: str | os.PathLike) -> Path:
    """The checkpoint prefix for a prefix, an ``.index`` file or a run directory.

    For a directory: the prefix named by its ``checkpoint`` file (only the file
    name is used, since the recorded path is often absolute on another machine)
    when that exists, else the ``*.index`` with the largest step number.
    """
    p = Path(path)
    if p.suffix == ".index" and p.is_file():
        return p.with_suffix("")
    if p.is_dir():
        state = p / "checkpoint"
        if state.is_file():
            m = re.search(r'^model_checkpoint_path:\s*"([^"]+)"', state.read_text(), re.M)
            if m:
                cand = p / Path(m.group(1)).name
                if cand.with_name(cand.name + ".index").is_file():
                    return cand
        indexes = sorted(p.glob("*.index"))
        if not indexes:
            raise FileNotFoundError(f"no TensorFlow checkpoint (*.index) in {p}")

        def step(f: Path) -> int:
            m = re.search(r"-(\d+)$", f.stem)
            return int(m.group(1)) if m else -1

        return max(indexes, key=step).with_suffix("")
    if Path(str(p) + ".index").is_file():
        return p
    raise FileNotFoundError(f"no TensorFlow checkpoint at {p} (expected {p}.index or a folder holding one)")


class TFCheckpointReader:
    """Tensors of a TensorFlow V2 checkpoint, read on demand.

    ``verify``: check each tensor's CRC32C. ``"auto"`` (default) checks every
    tensor when a compiled CRC32C module (google-crc32c or crc32c) is installed,
    and otherwise those up to ``crc_limit`` bytes (pure Python is slow: about
    10 MB/s). Sizes are always checked.
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool | str = "auto", crc_limit: int = 4 << 20):
        self.prefix = resolve_checkpoint_prefix(path)
        table = read_sstable(str(self.prefix) + ".index")
        header = table.pop(b"", None)
        if header is None:
            raise CheckpointFormatError(f"{self.prefix}.index: no bundle header")
        self.num_shards, endianness = 1, 0
        for num, _, val in _fields(header):
            if num == 1:
                self.num_shards = val
            elif num == 2:
                endianness = val
        if endianness != 0:
            raise CheckpointFormatError(f"{self.prefix}: big-endian checkpoints are not supported")
        self.entries = {k.decode("utf-8"): _parse_entry(k.decode("utf-8"), v) for k, v in table.items()}
        self.verify, self.crc_limit = verify, crc_limit
        for s in range(self.num_shards):
            f = self._shard_path(s)
            if not f.is_file():
                raise FileNotFoundError(f"checkpoint data file missing: {f}")

    def _shard_path(self, shard: int) -> Path:
        return Path(f"{self.prefix}.data-{shard:05d}-of-{self.num_shards:05d}")

    def names(self) -> list[str]:
        return sorted(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def read(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a numpy array (a copy)."""
        if name not in self.entries:
            raise KeyError(f"{name!r} not in checkpoint {self.prefix}")
        e = self.entries[name]
        if e.sliced:
            raise CheckpointFormatError(f"{name}: partitioned (sliced) variables are not supported")
        dt = e.numpy_dtype
        n = int(np.prod(e.shape, dtype=np.int64))
        if e.size != n * dt.itemsize:
            raise CheckpointFormatError(f"{name}: {e.size} bytes recorded for shape {e.shape} of {dt}")
        with open(self._shard_path(e.shard_id), "rb") as f:
            f.seek(e.offset)
            raw = f.read(e.size)
        if len(raw) != e.size:
            raise CheckpointFormatError(f"{name}: data file truncated ({len(raw)} of {e.size} bytes)")
        check = self.verify is True or (
            self.verify == "auto" and (FAST_CRC32C is not None or e.size <= self.crc_limit))
        if check and e.crc32c is not None and crc32c(raw) != e.crc32c:
            raise CheckpointFormatError(f"{name}: checksum mismatch in {self._shard_path(e.shard_id)}")
        return np.frombuffer(raw, dtype=dt).reshape(e.shape).copy()


def read_tf_checkpoint(path: str | os.PathLike, names=None, **kwargs) -> dict[str, np.ndarray]:
    """Every tensor (or those in ``names``) of a TensorFlow checkpoint, as numpy arrays."""
    reader = TFCheckpointReader(path, **kwargs)
    return {n: reader.read(n) for n in (names if names is not None else reader.names())}
