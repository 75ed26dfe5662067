# Usage: python minimal_writer.py <src_ckpt_dir> <dst_ckpt_dir>
# Emulates what a C++ writer could emit: a hand-rolled protocol-2 pickle of the Metadata that uses
# only this small opcode set (no memo, no FRAME, no STACK_GLOBAL):
#   PROTO GLOBAL EMPTY_TUPLE NEWOBJ EMPTY_DICT EMPTY_LIST MARK SETITEMS APPENDS BUILD TUPLE REDUCE
#   BINUNICODE BININT LONG1 NONE NEWTRUE NEWFALSE STOP
# The metadata content is taken from src (read with the real pickle just for this test), the
# .distcp files are copied unchanged.  Output is then checked with pickle.load / dcp.load.
import sys, os, shutil, struct, pickle
src, dst = sys.argv[1], sys.argv[2]
import torch
from torch.distributed.checkpoint.metadata import (Metadata, TensorStorageMetadata, BytesStorageMetadata,
    ChunkStorageMetadata, TensorProperties, MetadataIndex, StorageMeta)
from torch.distributed.checkpoint.filesystem import _StorageInfo
md = pickle.load(open(os.path.join(src, ".metadata"), "rb"))

M = "torch.distributed.checkpoint.metadata"
out = bytearray(b"\x80\x02")                       # PROTO 2
def glob(mod, name): out.extend(b"c" + mod.encode() + b"\n" + name.encode() + b"\n")
def s(x):
    b = x.encode("utf-8"); out.extend(b"X" + struct.pack("<I", len(b)) + b)
def i(x):
    if -2**31 <= x < 2**31: out.extend(b"J" + struct.pack("<i", x))
    else:
        n = (x.bit_length() + 8) // 8
        out.extend(b"\x8a" + bytes([n]) + x.to_bytes(n, "little", signed=True))
def tup(items):
    out.extend(b"("); [emit(v) for v in items]; out.extend(b"t")
def size(sz): glob("torch", "Size"); out.extend(b"("); tup(tuple(sz)); out.extend(b"t"); out.extend(b"R")
def newobj(mod, name): glob(mod, name); out.extend(b")\x81")
def build_dict(d):
    out.extend(b"}("); [ (s(k), emit(v)) for k, v in d.items() ]; out.extend(b"ub")
def emit(v):
    if v is None: out.extend(b"N")
    elif v is True: out.extend(b"\x88")
    elif v is False: out.extend(b"\x89")
    elif isinstance(v, torch.Size): size(v)
    elif isinstance(v, str): s(v)
    elif isinstance(v, int): i(v)
    elif isinstance(v, tuple): tup(v)
    elif isinstance(v, list):
        out.extend(b"]"); 
        if v: out.extend(b"("); [emit(x) for x in v]; out.extend(b"e")
    elif isinstance(v, dict):
        out.extend(b"}")
        if v: out.extend(b"("); [(emit(k), emit(x)) for k, x in v.items()]; out.extend(b"u")
    elif isinstance(v, torch.dtype): glob("torch", str(v).split(".")[1])
    elif isinstance(v, TensorProperties):
        newobj(M, "TensorProperties")
        out.extend(b"(")
        emit(v.dtype)
        glob("torch.serialization", "_get_layout"); out.extend(b"("); s(str(v.layout)); out.extend(b"tR")
        emit(v.requires_grad)
        glob(M, "_MEM_FORMAT_ENCODING"); out.extend(b"("); i(0); out.extend(b"tR")   # contiguous
        emit(v.pin_memory)
        out.extend(b"tb")                                  # BUILD with a 5-tuple -> __setstate__
    elif isinstance(v, TensorStorageMetadata):
        newobj(M, "TensorStorageMetadata"); build_dict({"properties": v.properties, "size": v.size, "chunks": v.chunks})
    elif isinstance(v, BytesStorageMetadata):
        newobj(M, "BytesStorageMetadata"); out.extend(b"}b")  # BUILD with empty dict (Python writes NEWOBJ only)
    elif isinstance(v, ChunkStorageMetadata):
        newobj(M, "ChunkStorageMetadata"); build_dict({"offsets": v.offsets, "sizes": v.sizes})
    elif isinstance(v, MetadataIndex):
        newobj(M, "MetadataIndex"); build_dict({"fqn": v.fqn, "offset": v.offset, "index": v.index})
    elif isinstance(v, _StorageInfo):
        d = {"relative_path": v.relative_path, "offset": v.offset, "length": v.length}
        if v.transform_descriptors: d["transform_descriptors"] = list(v.transform_descriptors)
        newobj("torch.distributed.checkpoint.filesystem", "_StorageInfo"); build_dict(d)
    else:
        raise TypeError(type(v))

newobj(M, "Metadata")
build_dict({"state_dict_metadata": md.state_dict_metadata,
            "planner_data": md.planner_data,
            "storage_data": md.storage_data,
            "storage_meta": None,
            "version": "1.0.0"})
out.extend(b".")
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(src, dst)
with open(os.path.join(dst, ".metadata"), "wb") as f:
    f.write(out)
md2 = pickle.load(open(os.path.join(dst, ".metadata"), "rb"))
assert md2.state_dict_metadata == md.state_dict_metadata
assert md2.storage_data == md.storage_data and md2.planner_data == md.planner_data
print("hand-written metadata:", len(out), "bytes; round-trips through pickle.load")
