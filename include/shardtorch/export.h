#pragma once
// SHARDTORCH_API marks what the shared libraries (shardtorch and
// shardtorch_testing) export: the library builds with hidden visibility, so
// everything else stays internal (docs/design.md, "Public surface").
#if defined(_WIN32)
#if defined(SHARDTORCH_BUILDING)
#define SHARDTORCH_API __declspec(dllexport)
#else
#define SHARDTORCH_API __declspec(dllimport)
#endif
#else
#define SHARDTORCH_API __attribute__((visibility("default")))
#endif
