# Usage: python make_minimal_variants.py <samples_dir>
# Copies a_fsdp2_fp32 into variants whose .metadata lacks optional fields, to find out what
# dcp.load / dcp_to_torch_save really need.  Variants (dir name -> change):
#   m_noversion      : Metadata.version = None
#   m_noplanner      : Metadata.planner_data = None
#   m_nostoragemeta  : Metadata.storage_meta = None
#   m_minimal        : all three None, and every MetadataIndex in storage_data has index=None
#   m_dictonly       : like m_minimal but the Metadata BUILD state contains ONLY
#                      state_dict_metadata and storage_data (fields absent, class defaults used)
import os, sys, shutil, pickle, copyreg, io, dataclasses
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
root = sys.argv[1]
src = os.path.join(root, "a_fsdp2_fp32")
md0 = pickle.load(open(os.path.join(src, ".metadata"), "rb"))

def variant(name, fn, pickler=None):
    d = os.path.join(root, name)
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(src, d)
    md = pickle.load(open(os.path.join(src, ".metadata"), "rb"))
    md = fn(md)
    with open(os.path.join(d, ".metadata"), "wb") as f:
        (pickler or pickle.Pickler)(f, protocol=4).dump(md)

variant("m_noversion", lambda m: dataclasses.replace(m, version=None))
variant("m_noplanner", lambda m: dataclasses.replace(m, planner_data=None))
variant("m_nostoragemeta", lambda m: dataclasses.replace(m, storage_meta=None))
def minimal(m):
    sd = {MetadataIndex(k.fqn, k.offset, None): v for k, v in m.storage_data.items()}
    return dataclasses.replace(m, version=None, planner_data=None, storage_meta=None, storage_data=sd)
variant("m_minimal", minimal)

class DictOnlyPickler(pickle.Pickler):
    def reducer_override(self, obj):
        if type(obj) is Metadata:
            return (copyreg.__newobj__, (Metadata,),
                    {"state_dict_metadata": obj.state_dict_metadata, "storage_data": obj.storage_data})
        return NotImplemented
variant("m_dictonly", minimal, DictOnlyPickler)
print("ok")
