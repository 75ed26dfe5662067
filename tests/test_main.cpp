#include <gtest/gtest.h>

#include "shardtorch/testing.h"

int main(int argc, char** argv) {
  shardtorch::testing::init();  // before anything starts ATen's thread pool: ranks are forked
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
