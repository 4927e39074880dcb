"""The kvshare radix cache: the only code that touches SGLang's tree, KV pool and allocator.

``adapter.KVShareRadixCache`` runs one request's path as a pipeline of
modules: ``plan`` -> ``resolve`` -> ``assemble`` -> ``record`` -> ``report``.
"""
