// Test entry point: memory accounting on, one intra-op thread per test process unless
// DHP_TEST_THREADS says otherwise.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdlib>

#include "dhp/core/memory.h"

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  dhp::install_memory_accounting();
  const char* t = std::getenv("DHP_TEST_THREADS");
  torch::set_num_threads(t ? std::atoi(t) : 1);
  return RUN_ALL_TESTS();
}
