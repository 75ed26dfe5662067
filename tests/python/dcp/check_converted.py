"""Checks shardtorch-convert's output against tests/data/dcp's sample a
(ctest tools.convert_dcp_hf_sharded): the Hugging Face layout it wrote loads
with safetensors as transformers reads it, and the DCP checkpoints it wrote
back convert with PyTorch's own dcp_to_torch_save; every tensor equal to the
sample's, bitwise.
usage: check_converted.py EXPECTED.safetensors HF_DIR DCP_FROM_HF DCP_FROM_SHARDED WORK"""
import json
import os
import sys
import warnings

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

warnings.filterwarnings("ignore")
expected, hf, from_hf, from_sharded, work = sys.argv[1:6]
want = load_file(expected)
model = {k[len("model."):]: v for k, v in want.items() if k.startswith("model.")}

index = json.load(open(os.path.join(hf, "model.safetensors.index.json")))
got = {}
for f in sorted(set(index["weight_map"].values())):
    got.update(load_file(os.path.join(hf, f)))
assert len(set(index["weight_map"].values())) > 1, "expected several files"
assert got.keys() == model.keys(), (sorted(got), sorted(model))
for k, v in model.items():
    assert torch.equal(got[k], v) and got[k].dtype == v.dtype, k

out = os.path.join(work, "from_hf.pt")
dcp_to_torch_save(from_hf, out)
nested = torch.load(out, weights_only=False)
assert nested["model"].keys() == model.keys(), sorted(nested["model"])
for k, v in model.items():
    assert torch.equal(nested["model"][k], v), k

# From a shardtorch sharded checkpoint of the same values: model and optimizer
# state, nested as get_state_dict lays them out.
out = os.path.join(work, "from_sharded.pt")
dcp_to_torch_save(from_sharded, out)
nested = torch.load(out, weights_only=False)
for k, v in model.items():
    assert torch.equal(nested["model"][k], v), k
for k, v in want.items():
    if k.startswith("optim.state.") and not k.endswith(".step"):
        name, kind = k[len("optim.state."):].rsplit(".", 1)
        assert torch.equal(nested["optim"]["state"][name][kind], v), k
    if k.endswith(".step"):
        name = k[len("optim.state."):-len(".step")]
        assert nested["optim"]["state"][name]["step"].item() == v.item(), k
print("converted checkpoints equal the sample")
