"""Build script for vegas_ext.

CPU kernels are always built. CUDA kernels are built when torch is a CUDA build
(``torch.version.cuda``) *and* a CUDA toolkit is found (``CUDA_HOME`` / nvcc) --
never decided by ``torch.cuda.is_available()``, so a GPU-less build machine
still compiles them. Overrides:

* ``VEGAS_BUILD_CUDA=0|1``   force CUDA off / on (on fails loudly without a toolkit)
* ``TORCH_CUDA_ARCH_LIST``   e.g. ``"9.0"``; default ``"8.0;9.0+PTX"``: machine code for
  sm80 (A100, and by binary compatibility sm86 / sm89: A10, L4, RTX 30xx / 40xx) and sm90
  (H100 / H200), plus PTX of sm90 that the driver JIT-compiles for newer GPUs (Blackwell,
  sm100 / sm120; the first launch then pays a one-time compile, cached by the driver)
* ``MAX_JOBS``               parallel compile jobs (ninja)
* ``VEGAS_DEBUG=1``          -O0 -g

The source list lives in ``csrc/SOURCES`` and is shared with CMakeLists.txt.
"""
import os
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
DEFAULT_ARCH_LIST = "8.0;9.0+PTX"


def read_sources():
    kinds = {"common": [], "cpu": [], "cuda": []}
    for line in (ROOT / "csrc" / "SOURCES").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        kind, path = line.split()
        kinds[kind].append(path)
    return kinds


def want_cuda():
    import torch
    from torch.utils import cpp_extension

    flag = os.environ.get("VEGAS_BUILD_CUDA")
    have_toolkit = torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
    if flag is not None and flag.strip() not in ("", "auto"):
        if flag.strip() in ("0", "false", "False", "no"):
            return False
        if not have_toolkit:
            raise RuntimeError(
                "VEGAS_BUILD_CUDA=1 but no CUDA build of torch plus CUDA toolkit was found "
                f"(torch.version.cuda={torch.version.cuda!r}, CUDA_HOME={cpp_extension.CUDA_HOME!r}); "
                "set CUDA_HOME=/usr/local/cuda or install a CUDA build of torch"
            )
        return True
    return have_toolkit


def cutlass_include_dirs():
    """Header folders of the `nvidia-cutlass` wheel (CUTLASS / CuTe), if installed."""
    try:
        import cutlass_library  # noqa: F401  (ships with nvidia-cutlass)
        base = Path(cutlass_library.__file__).resolve().parent / "source"
        dirs = [base / "include", base / "tools" / "util" / "include"]
        return [str(d) for d in dirs if d.is_dir()]
    except Exception:
        return []


def get_extensions():
    from torch.utils import cpp_extension

    srcs = read_sources()
    debug = os.environ.get("VEGAS_DEBUG", "0") == "1"
    opt = ["-O0", "-g"] if debug else ["-O3"]
    cxx_flags = opt + ["-std=c++20", "-fopenmp", "-ffp-contract=fast", "-Wno-psabi"]
    sources = srcs["common"] + srcs["cpu"]
    include_dirs = [str(ROOT / "csrc")]
    link_args = ["-fopenmp"]
    if want_cuda():
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", DEFAULT_ARCH_LIST)
        sources += srcs["cuda"]
        include_dirs += cutlass_include_dirs()
        nvcc_flags = opt + [
            "-std=c++20",
            "--expt-relaxed-constexpr",
            "--expt-extended-lambda",
            "-DVEGAS_WITH_CUDA",
            "-lineinfo",
        ]
        cxx_flags.append("-DVEGAS_WITH_CUDA")
        ext = cpp_extension.CUDAExtension(
            "vegas_ext._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags},
            extra_link_args=link_args,
            py_limited_api=True,
        )
    else:
        ext = cpp_extension.CppExtension(
            "vegas_ext._C",
            sources,
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx_flags},
            extra_link_args=link_args,
            py_limited_api=True,
        )
    return [ext]


def build_ext_cls():
    from torch.utils.cpp_extension import BuildExtension

    return BuildExtension.with_options(use_ninja=True)


setup(
    packages=find_packages("python"),
    py_modules=["vegas_ext_cli"],  # the `vegas` console script (see pyproject.toml)
    package_dir={"": "python"},
    ext_modules=get_extensions(),
    cmdclass={"build_ext": build_ext_cls()},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
