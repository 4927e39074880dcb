"""kvshare on ``/v1/chat/completions``: the ``kvshare`` request field, automatic annotation,
piece-wise template rendering and remembered answers (HTTP process)."""
