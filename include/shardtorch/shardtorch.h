#pragma once
// Everything a training program needs.
#include "shardtorch/collectives.h"
#include "shardtorch/flat_param.h"
#include "shardtorch/gather.h"
#include "shardtorch/memory.h"
#include "shardtorch/optim.h"
#include "shardtorch/reduce_scatter_bucketer.h"
#include "shardtorch/sharded.h"
#include "shardtorch/world.h"
#include "shardtorch/all_reduce_bucketer.h"
#include "shardtorch/clip.h"
#include "shardtorch/grad_scaler.h"
#include "shardtorch/checkpoint.h"
