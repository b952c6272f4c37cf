"""Write the installed torch's build facts as a CMake snippet (argv[1]) for CMakeLists.txt."""
import os
import sys

import torch
from torch.utils.cpp_extension import include_paths


def cmake_list(items):
    return ";".join(p.replace("\\", "/") for p in items)


with open(sys.argv[1], "w") as out:
    out.write(f'set(TORCH_INCLUDE_DIRS "{cmake_list(include_paths())}")\n')
    out.write(f'set(TORCH_LIB_DIR "{os.path.join(os.path.dirname(torch.__file__), "lib")}")\n')
    out.write(f"set(TORCH_CXX11_ABI {int(torch._C._GLIBCXX_USE_CXX11_ABI)})\n")
    out.write(f'set(TORCH_CUDA_VERSION "{torch.version.cuda or ""}")\n')
