"""SGLang wiring: the plugin entry point, every SGLang name kvshare uses (``sglang_targets``),
the launcher, and the hook functions that run inside SGLang's processes."""
