"""C++ CPU kernels (``csrc/*.cpp``), built as torch extensions by :mod:`engine.kernels.cpu.build`.

Each kernel has a plain-torch fallback that its caller uses when the extension is not built
(no compiler on the machine): the extension is a speed-up, never a requirement.
"""
