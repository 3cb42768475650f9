#include <gtest/gtest.h>

#include <c10/util/Exception.h>

#include "shardtrain/core/error.h"

using namespace shardtrain;

TEST(Errors, HierarchyLetsCallersCatchByKind) {
  EXPECT_THROW(throw TimeoutError("t"), CommError);
  EXPECT_THROW(throw CommError("c"), Error);
  EXPECT_THROW(throw ConfigError("c"), Error);
  EXPECT_THROW(throw CheckpointError("c"), Error);
  EXPECT_THROW(throw InvalidArgument("c"), Error);
}

TEST(Errors, CheckNamesTheValueAndTheCheckSite) {
  const int world = 3;
  try {
    ST_CHECK(world % 2 == 0, ConfigError, "world size ", world, " is odd");
    FAIL() << "ST_CHECK did not throw";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("world size 3 is odd"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[test_error.cpp:"), std::string::npos) << msg;
  }
}

TEST(Errors, AssertIsAnInternalErrorWithFileAndLine) {
  try {
    ST_ASSERT(1 + 1 == 3, "arithmetic");
    FAIL() << "ST_ASSERT did not throw";
  } catch (const InternalError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("test_error.cpp"), std::string::npos) << msg;
    EXPECT_NE(msg.find("1 + 1 == 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("arithmetic"), std::string::npos) << msg;
  }
}

TEST(Errors, OneLineMessageDropsLibTorchBacktraces) {
  try {
    TORCH_CHECK(false, "the tensor is wrong\nin two ways");
    FAIL() << "TORCH_CHECK did not throw";
  } catch (const c10::Error& e) {
    ASSERT_NE(std::string(e.what()).find("Exception raised from"), std::string::npos)
        << "LibTorch no longer puts a backtrace in what(): " << e.what();
    const std::string line = shardtrain::detail::one_line_message(e);
    EXPECT_EQ(line, "the tensor is wrong; in two ways");
    // The same text copied into one of our errors (as rank errors are).
    const CheckpointError ours(std::string("rank 1: ") + e.what());
    EXPECT_EQ(shardtrain::detail::one_line_message(ours), "rank 1: the tensor is wrong; in two ways");
  }
  EXPECT_EQ(shardtrain::detail::one_line_message(ConfigError("plain")), "plain");
}

// The check site ST_CHECK appends is for whoever debugs shardtrain: the line
// a user reads carries it only with SHARDTRAIN_DEBUG=1 (issue 28, item 14).
TEST(Errors, OneLineMessageHidesCheckSitesUnlessDebugging) {
  ::unsetenv("SHARDTRAIN_DEBUG");
  const ConfigError nested("cannot read 'x' [io.cpp:12]: bad header [safetensors.cpp:240]. Hint: y [a_b-c.h:7]");
  EXPECT_EQ(shardtrain::detail::one_line_message(nested), "cannot read 'x': bad header. Hint: y");
  // Brackets that are not check sites stay.
  EXPECT_EQ(shardtrain::detail::one_line_message(ConfigError("shape [2, 3] in [x.cpp] [y.cpp:] [z.txt:4]")),
            "shape [2, 3] in [x.cpp] [y.cpp:] [z.txt:4]");
  try {
    ST_CHECK(false, ConfigError, "world size 3 is odd");
  } catch (const ConfigError& e) {
    EXPECT_EQ(shardtrain::detail::one_line_message(e), "world size 3 is odd");
    ::setenv("SHARDTRAIN_DEBUG", "1", 1);
    EXPECT_NE(shardtrain::detail::one_line_message(e).find("[test_error.cpp:"), std::string::npos);
    ::unsetenv("SHARDTRAIN_DEBUG");
  }
}
