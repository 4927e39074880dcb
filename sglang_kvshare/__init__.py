"""sglang-kvshare: cross-agent KV reuse for SGLang.

Turn it on with ``python -m sglang_kvshare.launch_server`` (SGLang's launcher
plus ``--kvshare-*`` options). The subpackages, lowest layer first
(docs/ARCHITECTURE.md): ``correction`` (the math), ``learning`` (anchors from
dense prefills), ``cache`` (the radix cache SGLang runs), ``chat`` and
``admin`` (the HTTP side), ``server`` (SGLang wiring); ``kernels`` and
``frontend`` (the client library) install here from the repository's top level.
"""
