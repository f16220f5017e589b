"""Build script: metadata lives in setup.cfg; this file only adds the native extension.

The extension is built against the torch already installed (see pyproject.toml):
``pip install --no-build-isolation [-e] .``. It always has the CPU kernels; the
CUDA kernels are added when torch has CUDA and nvcc (CUDA_HOME) is found, for the
archs in TORCH_CUDA_ARCH_LIST (torch's default when unset).
VLLM_DFLASH2_SKIP_BUILD=1 skips it; the package then runs on the reference ops.
Knobs: VLLM_DFLASH2_SKIP_CUDA_BUILD=1 (CPU kernels only), DEBUG=1 (-O0 -g).
"""

import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def _extensions():
    if _flag("VLLM_DFLASH2_SKIP_BUILD"):
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    debug = _flag("DEBUG")
    use_cuda = (
        not _flag("VLLM_DFLASH2_SKIP_CUDA_BUILD")
        and torch.version.cuda is not None
        and CUDA_HOME is not None
    )
    # Relative paths: setuptools rejects absolute source paths in editable builds.
    sources = sorted(glob.glob("csrc/*.cpp", root_dir=ROOT) + glob.glob("csrc/cpu/*.cpp", root_dir=ROOT))
    opt = ["-O0", "-g"] if debug else ["-O3"]
    # No -std flag: torch picks the standard its headers need (C++20 for 2.13).
    cxx = opt + ["-fopenmp"]
    args = {"cxx": cxx}
    ext_cls = CppExtension
    if use_cuda:
        ext_cls = CUDAExtension
        sources += sorted(glob.glob("csrc/cuda/*.cu", root_dir=ROOT))
        args["cxx"] = cxx + ["-DVLLM_DFLASH2_CUDA"]
        args["nvcc"] = opt + ["-DVLLM_DFLASH2_CUDA"]
    ext = ext_cls(
        "vllm_dflash2._C",
        sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        extra_compile_args=args,
        extra_link_args=["-fopenmp"],
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
