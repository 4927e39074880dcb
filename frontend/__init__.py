"""Multi-agent sgl.function programs that mark shared segments (installed as sglang_kvshare.frontend)."""
