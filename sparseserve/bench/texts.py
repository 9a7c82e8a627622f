"""Real long text the project did not write, for the fidelity evaluation.

Sources, all read from the local Python installation (no downloads):

* ``code``     — Python standard-library modules (one module per text, from its top);
* ``docs``     — the Python documentation's topic pages that ``pydoc`` ships as data
                 (``pydoc_data/topics.py``), in sorted topic order;
* ``licenses`` — Python's LICENSE.txt followed by the license files of installed packages;
* ``news``     — IDLE's change log (``idlelib/NEWS.txt``, then ``NEWS2x.txt``).

``load_texts(tokenizer, length, n)`` returns ``n`` token lists of exactly ``length`` tokens,
cycling through the kinds; the k-th text of a kind starts further into its source, so texts
differ. Everything is deterministic for a given Python installation.
"""
from __future__ import annotations

import glob
import os
import sysconfig
from dataclasses import dataclass

KINDS = ("code", "docs", "licenses", "news")
CODE_MODULES = ("argparse.py", "difflib.py", "pathlib.py", "inspect.py", "typing.py",
                "tarfile.py", "pydoc.py", "subprocess.py")


@dataclass
class Text:
    name: str  # e.g. "code:argparse.py"
    kind: str
    token_ids: list[int]


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _code(k: int) -> tuple[str, str]:
    names = [m for m in CODE_MODULES if os.path.exists(os.path.join(stdlib_dir(), m))]
    name = names[k % len(names)]
    return name, _read(os.path.join(stdlib_dir(), name))


def _docs(k: int) -> tuple[str, str]:
    import importlib

    topics = importlib.import_module("pydoc_data.topics").topics
    keys = sorted(topics)
    start = (k * 17) % len(keys)  # each text starts at a different topic
    order = keys[start:] + keys[:start]
    return f"pydoc_data.topics[{order[0]}...]", "\n\n".join(topics[t] for t in order)


def _license_files() -> list[str]:
    files = [os.path.join(stdlib_dir(), "LICENSE.txt")]
    site = sysconfig.get_paths()["purelib"]
    pats = ("*.dist-info/LICENSE*", "*.dist-info/licenses/LICENSE*", "*.dist-info/COPYING*")
    found = sorted({p for pat in pats for p in glob.glob(os.path.join(site, pat))})
    return [f for f in files + found if os.path.isfile(f)]


def _licenses(k: int) -> tuple[str, str]:
    files = _license_files()
    start = (k * 5) % len(files)
    order = files[start:] + files[:start]
    parts = [f"==> {os.path.relpath(f, os.path.dirname(os.path.dirname(f)))} <==\n{_read(f)}"
             for f in order]
    return f"licenses[{os.path.basename(os.path.dirname(order[0]))}...]", "\n\n".join(parts)


def _news(k: int) -> tuple[str, str]:
    d = os.path.join(stdlib_dir(), "idlelib")
    text = "\n\n".join(_read(os.path.join(d, f)) for f in ("NEWS.txt", "NEWS2x.txt")
                       if os.path.exists(os.path.join(d, f)))
    start = k * len(text) // 5
    return f"idlelib/NEWS.txt[{start}:]", text[start:] + "\n\n" + text[:start]


SOURCES = {"code": _code, "docs": _docs, "licenses": _licenses, "news": _news}


def source_text(kind: str, k: int) -> tuple[str, str]:
    """(name, raw text) of the k-th text of a kind."""
    return SOURCES[kind](k)


def tokenize_to(tokenizer, text: str, length: int) -> list[int]:
    """The first `length` tokens of text (repeated if it is too short)."""
    chars = length * 6
    while True:
        ids = tokenizer.encode(text[:chars], add_special_tokens=False)
        if len(ids) > length or chars >= len(text):
            break
        chars *= 2
    while len(ids) < length:  # a short source: repeat it
        ids = ids + ids
    return ids[:length]


def load_texts(tokenizer, length: int, n: int, kinds=KINDS) -> list[Text]:
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        name, raw = source_text(kind, i // len(kinds))
        out.append(Text(f"{kind}:{name}", kind, tokenize_to(tokenizer, raw, length)))
    return out
