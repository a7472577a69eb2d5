"""Test rules: gtest binaries alone, and under mpirun at several world sizes."""

def remat_cc_test(name, srcs, deps = [], **kwargs):
    """A single-process gtest binary with remat's summary line."""
    native.cc_test(
        name = name,
        srcs = srcs,
        deps = deps + ["//tests:gtest_main"],
        **kwargs
    )

def remat_mpi_test(name, srcs, deps = [], world_sizes = [1, 2, 3, 4], tags = [], **kwargs):
    """A gtest binary run by mpirun once per world size: NAME_np1, NAME_np2, ..."""
    native.cc_binary(
        name = name + "_bin",
        srcs = srcs,
        deps = deps + ["//tests:mpi_gtest_main"],
        testonly = True,
        tags = tags,
    )
    tests = []
    for np in world_sizes:
        native.sh_test(
            name = "%s_np%d" % (name, np),
            srcs = ["//launch:remat-run.sh"],
            args = ["-np", str(np), "--", "$(location :%s_bin)" % name],
            data = [":%s_bin" % name],
            # A hung collective fails the test within a minute instead of hanging it.
            env = {"REMAT_COMM_TIMEOUT_S": "60"},
            # Open MPI's shared-memory transport crashes inside linux-sandbox.
            tags = tags + ["mpi", "no-sandbox"],
            **kwargs
        )
        tests.append(":%s_np%d" % (name, np))
    native.test_suite(name = name, tests = tests, tags = tags)
