"""sglang-kvshare: cross-agent KV reuse for SGLang."""
