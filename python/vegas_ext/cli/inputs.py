"""The prompts: read (flags, file, stdin or the embedded document), encoded, left-padded into a
batch; and the new tokens cut out of the output. Torch is imported only inside the functions."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any, List, Sequence

from .arguments import CLIError
from .common import _eprint


@dataclass
class Batch:
    """The encoded prompts of one run.

    ``rows``: each row's prompt token ids (unpadded); ``ids`` / ``mask``: ``[B, L]`` int64 tensors
    on the run's device, left-padded with ``pad_id``; ``eos``: the ids that end a row (``[]``: never
    stop); ``max_new``: new tokens per row (``--max-new-tokens``, lowered to fit the positions).
    """

    rows: List[List[int]]
    ids: Any
    mask: Any
    pad_id: int
    eos: List[int]
    max_new: int

    @property
    def size(self) -> int:
        """B, the number of rows."""
        return len(self.rows)

    @property
    def longest(self) -> int:
        """The longest prompt, in tokens."""
        return max(len(r) for r in self.rows)


def _read_prompts(args) -> List[str]:
    """The prompt texts, one per row (``--batch-size`` repeats them cyclically); raises
    :class:`CLIError` for a missing, unreadable or empty file."""
    if args.prompt_file is not None:
        prompts = [_read_prompt_file(args.prompt_file)]
    elif args.prompt:
        prompts = list(args.prompt)
    else:
        from ..documents import default_prompt

        prompts = [default_prompt()]
    n = args.batch_size or len(prompts)
    return [prompts[i % len(prompts)] for i in range(n)]


def _read_prompt_file(path: str) -> str:
    """``--prompt-file``: the text of ``path`` (``-``: stdin), which must not be blank."""
    if path == "-":
        text = _read_stdin()
    else:
        if os.path.isdir(path):
            raise CLIError(f"--prompt-file {path} is a directory, not a text file")
        # any other readable path: a pipe (<(cmd), /dev/fd/N, a FIFO) or a device as well as a file;
        # utf-8-sig: a byte-order mark some editors write is not part of the prompt
        try:
            with open(path, encoding="utf-8-sig") as f:
                text = f.read()
        except FileNotFoundError:
            raise CLIError(f"--prompt-file {path}: not found") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CLIError(f"--prompt-file {path}: cannot read it ({e})") from None
    if not text.strip():
        raise CLIError(f"--prompt-file {path}: the file is empty or blank")
    return text


def _read_stdin() -> str:
    """The prompt from stdin (``--prompt-file -``) as UTF-8 text, whatever the locale says."""
    if sys.stdin is None:  # stdin closed (`<&-`) or none given (pythonw, some embedders)
        raise CLIError("--prompt-file -: no stdin to read (it is closed)")
    buf = getattr(sys.stdin, "buffer", None)
    try:
        if buf is None:  # a text stream without bytes underneath (tests, embedding)
            return sys.stdin.read()
        return buf.read().decode("utf-8-sig").replace("\r\n", "\n").replace("\r", "\n")  # as text mode's newlines
    except UnicodeDecodeError as e:
        raise CLIError(f"--prompt-file -: stdin is not UTF-8 text ({e})") from None
    except (OSError, ValueError) as e:  # a stdin that cannot be read (closed file object, EBADF, EISDIR)
        raise CLIError(f"--prompt-file -: cannot read stdin ({e})") from None


def make_batch(tok, model, prompts: List[str], args, device, show: bool) -> Batch:
    """Encodes ``prompts`` (with the chat template under ``--chat``), fits ``--max-new-tokens`` to
    the model's positions and left-pads the rows on ``device``."""
    rows = _encode(tok, prompts, args.chat)
    max_new = _fit_positions(model, rows, args.max_new_tokens, show)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    ids, mask = _left_pad(rows, pad_id, device)
    eos = [] if args.ignore_eos else _eos_ids(model, tok)
    return Batch(rows=rows, ids=ids, mask=mask, pad_id=pad_id, eos=eos, max_new=max_new)


def _encode(tok, prompts: List[str], chat: bool) -> List[List[int]]:
    out = []
    for p in prompts:
        if chat:
            if not getattr(tok, "chat_template", None):
                raise CLIError("--chat: this tokenizer has no chat template")
            ids = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=True,
                                          add_generation_prompt=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            ids = list(ids)
        else:
            ids = tok(p).input_ids
        if not ids:
            raise CLIError("a prompt encodes to zero tokens")
        out.append([int(t) for t in ids])
    return out


def _fit_positions(model, rows, max_new: int, show: bool) -> int:
    max_pos = getattr(model.config, "max_position_embeddings", None)
    longest = max(len(r) for r in rows)
    if max_pos is not None:
        if longest >= max_pos:
            raise CLIError(f"prompt has {longest} tokens but the model has only {max_pos} positions "
                           f"(room for at most {max_pos - 1} prompt tokens)")
        if longest + max_new > max_pos:
            max_new = max_pos - longest
            if show:
                _eprint(f"vegas: note: --max-new-tokens lowered to {max_new} to fit the model's {max_pos} positions")
    return max_new


def _left_pad(rows: List[List[int]], pad_id: int, device):
    import torch

    L = max(len(r) for r in rows)
    ids = torch.full((len(rows), L), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, L - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, L - len(r):] = 1
    return ids.to(device), mask.to(device)


def _eos_ids(model, tok) -> List[int]:
    e = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if e is None:
        e = tok.eos_token_id
    if e is None:
        return []
    return [int(x) for x in (e if isinstance(e, (list, tuple)) else [e])]


def new_tokens(sequences, prompt_len: int, eos_ids: Sequence[int], max_new_tokens: int) -> List[List[int]]:
    """New tokens of each row of ``sequences`` (``[B, prompt_len + new]``), cut after the first EOS."""
    rows = []
    for r in sequences[:, prompt_len:].tolist():
        r = r[:max_new_tokens]
        for i, t in enumerate(r):
            if t in eos_ids:
                r = r[: i + 1]
                break
        rows.append(r)
    return rows
