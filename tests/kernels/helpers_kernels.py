"""Random inputs shaped like SGLang's KV pools for the kernel tests."""

from __future__ import annotations

import torch

# (dtype, atol, rtol) of kernel (fp32 accumulation) vs reference (float64, rounded
# once): both round the same exact value to the pool dtype, so they differ by at
# most about one ulp of that dtype; fp32 leaves room for cos/sin rounded to fp32
# and fp32 sums over Vn * r products.
DTYPE_TOLS = [
    (torch.float32, 1e-4, 1e-4),
    (torch.bfloat16, 2e-2, 1.6e-2),
    (torch.float16, 2e-3, 2e-3),
]


def llama_inv_freq(rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)).float()


def paged_indices(num_tokens: int, page_size: int, num_pages: int, gen: torch.Generator,
                  exclude_pages: torch.Tensor | None = None, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token slots of a segment that starts ``offset`` tokens into its first page; returns (slots, pages used)."""
    need = (offset + num_tokens + page_size - 1) // page_size
    pages = torch.randperm(num_pages, generator=gen)
    if exclude_pages is not None:
        pages = pages[~torch.isin(pages, exclude_pages)]
    pages = pages[:need]
    slots = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
    return slots[offset: offset + num_tokens].contiguous(), pages
