"""Render a chat prompt so that every message's content is tokenized on its own.

Why: the cache recognises a shared text by its token ids. Tokenizing a whole
rendered prompt lets a BPE merge run across the boundary between the template
text (``<|im_start|>user\\n``) and a message's content, so the same message
could get different ids behind different agents. Here the template is rendered
once with a unique sentinel in place of each message's content; the rendered
text is cut at the sentinels, and template text and contents are tokenized
piece by piece. The pieces joined back must give exactly the text the template
renders with the real contents (checked), so a template that rewrites content
(trims it, escapes it, branches on it) is detected and refused, never guessed.

Against SGLang's own rendering the ids are identical whenever every cut falls
on a pre-token boundary of the tokenizer. For ChatML-style templates the cuts
sit next to special tokens or after the ``\\n`` that ends a role header, which
a byte-level BPE pre-tokenizer (GPT-2, Llama-3, SmolLM2) never merges with a
following letter, digit, punctuation or space; ``tests/chat/test_render.py``
checks it on real text. The caller compares the result with SGLang's ids and
reports any difference.

No SGLang imports: unit testable with any Hugging Face tokenizer.
"""

from __future__ import annotations

import re
import secrets
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

# Private-use code points (no chat template or tokenizer gives them a meaning) around a random
# nonce drawn per rendering: a message that holds sentinel-like text can never be mistaken for one.
_SENTINEL = "\ue000kvshare-{nonce}-{index}\ue001"


def _sentinel_re(nonce: str) -> re.Pattern:
    return re.compile("\ue000kvshare-" + re.escape(nonce) + "-([0-9]+)\ue001")

Render = Callable[[list[dict[str, Any]]], str]
Tokenize = Callable[[list[str]], Sequence[Sequence[int]]]
"""The ids of each text, tokenized on its own without special tokens, in one call for all of them.

Why batched: a long chat cuts into thousands of pieces of a few tokens each, and one call of a
tokenizer costs far more than the tokens of one piece.
"""


def tokenize_each(tokenize: Tokenize, texts: Iterable[str]) -> dict[str, tuple[int, ...]]:
    """The ids of every distinct text of ``texts`` (keyed by text), from one call of ``tokenize``."""
    distinct = list(dict.fromkeys(t for t in texts if t))
    ids: dict[str, tuple[int, ...]] = {"": ()}
    if distinct:
        ids.update(zip(distinct, (tuple(x) for x in tokenize(distinct))))
    return ids


class TemplateSplitError(ValueError):
    """The chat template cannot be cut at message contents; the message says why."""


@dataclass(frozen=True)
class Piece:
    """A run of rendered prompt text: template text (``message is None``) or one message's content."""

    text: str
    message: Optional[int] = None


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt cut into pieces, each tokenized alone; ``ids`` is their concatenation."""

    pieces: tuple[Piece, ...]
    piece_ids: tuple[tuple[int, ...], ...]

    @property
    def ids(self) -> list[int]:
        return [t for ids in self.piece_ids for t in ids]

    def content_messages(self) -> set[int]:
        """Indices of the messages whose content forms a piece of its own."""
        return {p.message for p in self.pieces if p.message is not None}


def split_rendered(render: Render, messages: Sequence[dict[str, Any]],
                   cut: Optional[set[int]] = None) -> list[Piece]:
    """Cut the rendered prompt at the contents of the messages in ``cut`` (default: all).

    ``render`` maps a message list to the prompt text (the chat template with
    the caller's tools and options). A message whose content is not a string,
    is empty, or does not appear exactly once in the render stays part of the
    template text, and so does every message not in ``cut``. Raises
    ``TemplateSplitError`` when the cut pieces do not join back into the real
    rendering.
    """
    full = render([dict(m) for m in messages])
    nonce = secrets.token_hex(8)
    sentinel_re = _sentinel_re(nonce)
    probe = []
    candidates: set[int] = set()
    for i, m in enumerate(messages):
        m = dict(m)
        content = m.get("content")
        if (cut is None or i in cut) and isinstance(content, str) and content:
            m["content"] = _SENTINEL.format(nonce=nonce, index=i)
            candidates.add(i)
        probe.append(m)
    templated = render(probe)
    found = Counter(int(x) for x in sentinel_re.findall(templated))
    once = {i for i in candidates if found[i] == 1}
    pieces: list[Piece] = []
    pos = 0
    template_text: list[str] = []
    for match in sentinel_re.finditer(templated):
        i = int(match.group(1))
        template_text.append(templated[pos:match.start()])
        pos = match.end()
        content = messages[i]["content"]
        if i in once:
            if template_text:
                pieces.append(Piece("".join(template_text)))
                template_text = []
            pieces.append(Piece(content, i))
        else:
            template_text.append(content)
    template_text.append(templated[pos:])
    tail = "".join(template_text)
    if tail:
        pieces.append(Piece(tail))
    pieces = [p for p in pieces if p.text]
    if "".join(p.text for p in pieces) != full:
        raise TemplateSplitError(
            "the chat template does not render message contents verbatim (it trims, escapes or branches "
            "on them), so messages cannot be tokenized on their own")
    return pieces


def render_pieces(render: Render, tokenize: Tokenize, messages: Sequence[dict[str, Any]],
                  cut: Optional[set[int]] = None) -> RenderedPrompt:
    """``split_rendered`` plus tokenization of each piece on its own (no special tokens added)."""
    pieces = split_rendered(render, messages, cut)
    ids = tokenize_each(tokenize, (p.text for p in pieces))
    return RenderedPrompt(tuple(pieces), tuple(ids[p.text] for p in pieces))


_PROBE_CHARS = 64


def safe_messages(tokenize: Tokenize, pieces: Sequence[Piece]) -> set[int]:
    """The messages of ``pieces`` whose content pieces cut the prompt where the tokenizer cuts anyway.

    A content is safe when tokenizing it alone gives the ids it gets between
    its neighbours, checked at both cuts on a window of ``_PROBE_CHARS``
    characters (pre-tokens are local); ``align_to_stock`` then confirms the
    whole prompt. All windows are tokenized in one call.
    """
    windows: dict[int, tuple[str, str, str, str]] = {}
    for k, piece in enumerate(pieces):
        if piece.message is None:
            continue
        left = pieces[k - 1].text if k > 0 else ""
        right = pieces[k + 1].text if k + 1 < len(pieces) else ""
        windows[piece.message] = (left[-_PROBE_CHARS:], piece.text[:_PROBE_CHARS], piece.text[-_PROBE_CHARS:],
                                  right[:_PROBE_CHARS])
    ids = tokenize_each(tokenize, (t for lwin, head, tail, rwin in windows.values()
                                   for t in (lwin + head, lwin, head, tail + rwin, tail, rwin)))
    return {m for m, (lwin, head, tail, rwin) in windows.items()
            if ids[lwin + head] == ids[lwin] + ids[head] and ids[tail + rwin] == ids[tail] + ids[rwin]}


def align_to_stock(prompt: RenderedPrompt, stock_ids: Sequence[int]) -> tuple[RenderedPrompt, bool]:
    """Match a rendering against the ids the server computes without kvshare.

    Returns the prompt (with any leading ids the stock encoding adds, such as a
    BOS token, prepended as template text) and whether the ids are now
    identical to ``stock_ids``.
    """
    ids = prompt.ids
    stock = list(stock_ids)
    if len(stock) > len(ids) and stock[len(stock) - len(ids):] == ids:
        head = tuple(stock[: len(stock) - len(ids)])
        prompt = RenderedPrompt((Piece(""),) + prompt.pieces, (head,) + prompt.piece_ids)
        ids = prompt.ids
    return prompt, ids == stock
