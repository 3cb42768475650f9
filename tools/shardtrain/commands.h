// The subcommands of the `shardtrain` tool, one file each.
#pragma once

namespace shardtrain::cli {

/// `shardtrain launch ... -- PROGRAM ARGS`; argv[0] is "launch".
int launch_main(int argc, char** argv);

/// `shardtrain bench-comm --op OP --bytes B ...`; argv[0] is "bench-comm".
int bench_comm_main(int argc, char** argv);

}  // namespace shardtrain::cli
