#pragma once
// Sharded modules: units marked in the model's definition, and shard().
// This header includes the three that say it: shard_options.h (ShardOptions),
// unit.h (Sharded<Impl>, SHARDTORCH_MODULE) and sharded_model.h (shard(),
// ShardedModel).
//
// A unit is a module declared as shardtorch::Sharded<Impl>: an Impl whose
// forward wraps the original. Before shard() it is a plain pass-through.
// shard(root, world, options) gives every parameter to its innermost unit (a
// parameter shared by several units to their lowest common ancestor unit; the
// rest to the root, which must then be a unit), lays each unit's parameters of
// one dtype (and one requires_grad) end to end in a FlatParam, keeps this
// rank's shard and frees the rest.
//
// The life of a unit in one training step is in docs/design.md ("States").
#include "shardtorch/shard_options.h"
#include "shardtorch/sharded_model.h"
#include "shardtorch/unit.h"
