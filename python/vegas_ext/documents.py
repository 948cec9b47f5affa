"""Real long documents for demos and benchmarks, shipped as package data or read from the stdlib.

* ``pride_and_prejudice``: Jane Austen's novel (1813, public domain), whole text.
* ``kjv``: the King James Bible (1611), Genesis and Exodus (public domain outside the UK).
* ``python_docs``: the Python language reference topics from the standard library's
  ``pydoc_data/topics.py`` (PSF license; read at run time, not shipped; its text follows the
  running Python version).

The default prompt of ``vegas generate`` is :func:`default_prompt`: the first five chapters of
*Pride and Prejudice* (7,128 SmolLM2 tokens; 7,182 with the instruction and the chat template)
followed by an instruction to summarize them.
See ``data/README.md`` for sources and licenses.
"""
from __future__ import annotations

import functools
import gzip
import os
from typing import Dict, List, Optional

DATA_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")

#: Instruction appended to benchmark prompts, per document.
INSTRUCTIONS: Dict[str, str] = {
    "pride_and_prejudice": ("Summarize the story above in a few sentences: who are the main characters, "
                            "and what happens to them?"),
    "kjv": "Summarize the passage above in a few sentences: who are the main figures, and what happens to them?",
    "python_docs": ("Summarize the documentation above in a few sentences: which parts of the Python "
                    "language does it describe?"),
}


def list_documents() -> List[str]:
    """Names accepted by :func:`load_document`."""
    return list(INSTRUCTIONS)


def _read_data(name: str) -> str:
    path = os.path.join(DATA_DIR, name)
    if name.endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    with open(path, encoding="utf-8") as f:
        return f.read()


def _python_docs() -> str:
    from pydoc_data.topics import topics

    parts = [f"{name}\n{'*' * len(name)}\n\n{text.strip()}" for name, text in topics.items()]
    return "Python language reference (pydoc topics)\n\n" + "\n\n\n".join(parts) + "\n"


@functools.lru_cache(maxsize=None)
def load_document(name: str) -> str:
    """Full text of the document ``name`` (one of :func:`list_documents`)."""
    if name == "pride_and_prejudice":
        return _read_data("pride_and_prejudice.txt.gz")
    if name == "kjv":
        return _read_data("kjv_genesis_exodus.txt.gz")
    if name == "python_docs":
        return _python_docs()
    raise ValueError(f"unknown document {name!r}; choose from {', '.join(list_documents())}")


def default_document() -> str:
    """The embedded default document: chapters 1-5 of *Pride and Prejudice*."""
    return _read_data("default_document.txt").rstrip() + "\n"


def default_instruction() -> str:
    """The instruction that follows the default document."""
    return _read_data("default_instruction.txt").strip()


def default_prompt() -> str:
    """Default prompt of ``vegas generate``: :func:`default_document`, a blank line, :func:`default_instruction`."""
    return default_document() + "\n" + default_instruction()


def chat_wrap_ids(tokenizer, content_ids: List[int]) -> List[int]:
    """Wraps already-tokenized user content in the tokenizer's chat template (user turn + generation prompt)."""
    marker = "\u2063VEGASMARKER\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    pre, post = text.split(marker)
    enc = lambda s: tokenizer(s, add_special_tokens=False).input_ids if s else []
    return enc(pre) + list(content_ids) + enc(post)


def make_prompt_ids(
    tokenizer,
    document: str,
    num_tokens: int,
    instruction: Optional[str] = None,
    chat: bool = False,
) -> List[int]:
    """Token ids of a prompt exactly ``num_tokens`` long: the start of ``document``, then the instruction.

    ``document`` is a name from :func:`list_documents` or a literal text (anything else).
    The document's tokens are cut so that document + ``"\\n\\n" + instruction`` (and the chat
    template when ``chat``) total ``num_tokens``; the instruction defaults to the document's
    entry in :data:`INSTRUCTIONS`. Raises ``ValueError`` if the document is too short.
    """
    if document in INSTRUCTIONS:
        instruction = INSTRUCTIONS[document] if instruction is None else instruction
        document = load_document(document)
    instruction = instruction or ""
    suffix = tokenizer("\n\n" + instruction, add_special_tokens=False).input_ids if instruction else []
    wrap_len = len(chat_wrap_ids(tokenizer, [])) if chat else 0
    n_doc = num_tokens - len(suffix) - wrap_len
    if n_doc < 1:
        raise ValueError(f"num_tokens={num_tokens} leaves no room for the document")
    # Tokenize only as much text as needed (about 3 characters per token at least, grow if short).
    chars = max(4 * n_doc, 1024)
    while True:
        ids = tokenizer(document[:chars], add_special_tokens=False).input_ids
        if len(ids) > n_doc or chars >= len(document):
            break
        chars *= 2
    if len(ids) < n_doc:
        raise ValueError(f"document has only {len(ids)} tokens; {n_doc} needed")
    content = ids[:n_doc] + suffix
    out = chat_wrap_ids(tokenizer, content) if chat else content
    assert len(out) == num_tokens, (len(out), num_tokens)
    return out
