# Writes a sample's expected values as safetensors for the C++ tests: every
# tensor under its flattened DCP key (contiguous), and every other value's
# Python repr in the metadata under its key.
# usage: python expected_values.py <reference.pt> <out.safetensors>
import sys

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

ref = torch.load(sys.argv[1], weights_only=False)
flat, _ = flatten_state_dict(ref)
tensors = {k: v.contiguous() for k, v in flat.items() if isinstance(v, torch.Tensor)}
values = {k: repr(v) for k, v in flat.items() if not isinstance(v, torch.Tensor)}
save_file(tensors, sys.argv[2], metadata=values)
