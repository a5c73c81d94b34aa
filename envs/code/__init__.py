"""Code environments and the sandbox they run programs in.

- :mod:`envs.code.sandbox`: isolation layers and limits for untrusted Python and C++ programs (g++ inside the layers).
- :mod:`envs.code.judge`: programs against tests (stdin/stdout, function calls, assertions).
- :mod:`envs.code.envs`: the ZAYA1 stage-3 code environments (solve, io_predict, io_propose, arc, falsify).
- :mod:`envs.code.cli`: ``cascade sandbox run|judge``.
"""
