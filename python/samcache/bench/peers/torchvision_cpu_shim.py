"""Installed into vLLM's environment by ``make vllm-env`` (with a ``.pth`` that imports it), never
imported by samcache itself.

PyPI's torchvision is a CUDA build whose C++ ops do not load beside a CPU torch, and vLLM imports
it; its pure-Python parts work once these two registration modules are stand-ins.
"""

import sys
import types

for _name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
    sys.modules.setdefault(_name, types.ModuleType(_name))
