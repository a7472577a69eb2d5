"""Detects CUDA and NCCL when the build is configured.

CUDA is found through CUDA_HOME, else through nvcc on PATH. REMAT_CUDA=0 turns
detection off. The generated repository always defines:
  :cuda      cc_library with the CUDA runtime and NCCL (empty when absent)
  defs.bzl   HAVE_CUDA and if_cuda(yes, no)
"""

def _find_cuda(ctx):
    if ctx.os.environ.get("REMAT_CUDA", "1") == "0":
        return None
    home = ctx.os.environ.get("CUDA_HOME", "")
    if not home:
        nvcc = ctx.which("nvcc")
        if nvcc:
            home = str(nvcc.dirname.dirname)
    if not home:
        return None
    root = ctx.path(home)
    for needed in ["cuda_runtime_api.h", "nccl.h"]:
        if not ctx.path(home + "/include/" + needed).exists:
            print("remat: CUDA at %s lacks %s; building without NCCL" % (home, needed))
            return None
    return root

def _cuda_configure_impl(ctx):
    root = _find_cuda(ctx)
    if root == None:
        ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])
cc_library(name = "cuda")
""")
        ctx.file("defs.bzl", """
HAVE_CUDA = False

def if_cuda(yes, no = []):
    return no
""")
        return

    ctx.symlink(root.get_child("include"), "include")
    libdir = None
    for candidate in ["lib64", "lib", "targets/x86_64-linux/lib"]:
        if ctx.path(str(root) + "/" + candidate + "/libcudart.so").exists:
            libdir = ctx.path(str(root) + "/" + candidate)
            break
    if libdir == None:
        fail("remat: CUDA at %s has no libcudart.so; set REMAT_CUDA=0 to build without it" % root)
    ctx.symlink(libdir.get_child("libcudart.so"), "lib/libcudart.so")
    nccl = libdir.get_child("libnccl.so")
    if not nccl.exists:
        fail("remat: CUDA at %s has no libnccl.so; set REMAT_CUDA=0 to build without it" % root)
    ctx.symlink(nccl, "lib/libnccl.so")
    ctx.file("BUILD", """
package(default_visibility = ["//visibility:public"])
cc_library(
    name = "cuda",
    srcs = ["lib/libcudart.so", "lib/libnccl.so"],
    hdrs = glob(["include/*.h", "include/*.hpp", "include/crt/**", "include/nccl_device/**", "include/cccl/nv/**"]),
    # cuda_fp16.h includes <nv/target>, which CUDA 13 keeps under include/cccl.
    includes = ["include", "include/cccl"],
    defines = ["REMAT_WITH_NCCL=1"],
)
""")
    ctx.file("defs.bzl", """
HAVE_CUDA = True

def if_cuda(yes, no = []):
    return yes
""")

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["CUDA_HOME", "PATH", "REMAT_CUDA"],
    local = True,
)
