# Usage: python make_nodist.py <samples_dir>
# Non-distributed dcp.save (no process group initialised) of:
#   c_nodist_plain   : flat dict of plain tensors, several dtypes (the canonical "dict of tensors" case)
#   d_nodist_edge    : edge cases: 0-d, empty, non-contiguous (transposed), view into a larger
#                      storage, nested dict/list, non-tensor values (int, float, str, list of str, None)
#   e_nodist_multi   : c's dict with FileSystemWriter(single_file_per_rank=False) (one file per item)
#   f_nodist_zstd    : c's dict with FileSystemWriter(_extensions=[ZStandard()]) (needs zstandard)
#   g_nodist_hf      : c's float dict with HuggingFaceStorageWriter (safetensors, no .metadata)
#   h_nodist_st      : c's dict with FileSystemWriter(serialization_format=SAFETENSORS)
#   o_single_key     : {'w': torch.ones(2)} -> one-entry dicts are pickled with SETITEM (not MARK/SETITEMS)
# Writes <name>.expected.pt next to each directory for verification.
import os, sys, warnings, shutil
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat

warnings.filterwarnings("ignore")
root = sys.argv[1]
torch.manual_seed(0)

def fresh(name):
    p = os.path.join(root, name)
    shutil.rmtree(p, ignore_errors=True)
    return p

plain = {
    "w_f32": torch.randn(3, 4),
    "w_bf16": torch.randn(2, 3).to(torch.bfloat16),
    "w_f16": torch.randn(5).to(torch.float16),
    "w_f64": torch.randn(2, 2, dtype=torch.float64),
    "i64": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "i32": torch.tensor([1, -2, 3], dtype=torch.int32),
    "u8": torch.tensor([0, 255, 7], dtype=torch.uint8),
    "b": torch.tensor([True, False, True]),
}
p = fresh("c_nodist_plain"); dcp.save(plain, checkpoint_id=p)
torch.save(plain, p + ".expected.pt")

big = torch.arange(20, dtype=torch.float32)
edge = {
    "scalar": torch.tensor(3.5),
    "empty": torch.empty(0, 4),
    "transposed": torch.arange(6, dtype=torch.float32).reshape(2, 3).t(),  # non-contiguous, storage == nbytes
    "view": big[5:11].view(2, 3),      # view into larger storage -> cloned before torch.save
    "nested": {"a": torch.ones(2), "b": {"c": torch.zeros(1, dtype=torch.int64)}},
    "lst": [torch.full((2,), 7.0), torch.full((1,), 8.0)],
    "int_val": 42,
    "float_val": 0.5,
    "str_val": "hello",
    "str_list": ["x", "y"],
    "none_val": None,
    "tuple_val": (1, 2),
}
p = fresh("d_nodist_edge"); dcp.save(edge, checkpoint_id=p)
torch.save(edge, p + ".expected.pt")

p = fresh("e_nodist_multi")
dcp.save(plain, storage_writer=FileSystemWriter(p, single_file_per_rank=False))
torch.save(plain, p + ".expected.pt")

try:
    from torch.distributed.checkpoint._extension import ZStandard
    p = fresh("f_nodist_zstd")
    dcp.save(plain, storage_writer=FileSystemWriter(p, _extensions=[ZStandard()]))
    torch.save(plain, p + ".expected.pt")
except Exception as e:
    print("zstd sample skipped:", e)

floats = {k: v for k, v in plain.items() if v.dtype.is_floating_point}
try:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    p = fresh("g_nodist_hf")
    dcp.save(floats, storage_writer=HuggingFaceStorageWriter(p))
    torch.save(floats, p + ".expected.pt")
except Exception as e:
    print("hf sample skipped:", repr(e))

try:
    p = fresh("h_nodist_st")
    dcp.save(floats, storage_writer=FileSystemWriter(p, serialization_format=SerializationFormat.SAFETENSORS))
    torch.save(floats, p + ".expected.pt")
except Exception as e:
    print("safetensors-format sample skipped:", repr(e))
one = {"w": torch.ones(2)}
p = fresh("o_single_key"); dcp.save(one, checkpoint_id=p)
torch.save(one, p + ".expected.pt")
print("done")
