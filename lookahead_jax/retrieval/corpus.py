"""A retrieval corpus: passages with an `id`, `text` and optional `title`, read from JSON Lines.

    corpus = Corpus.from_jsonl("wiki_passages.jsonl")   # {"id": ..., "text": ..., "title": ...}
    corpus[3].text, corpus.contents(3), len(corpus), corpus.fingerprint

Retrievers return *positions* in the corpus (0..N-1, np.int64), never the passages' own `id`
strings: positions are what arrays can hold and what a cache of documents can store. The
passage's `id` is kept for reporting (`corpus[i].id`).

`fingerprint` is the sha256 of the file's bytes (of a canonical JSON Lines dump for a corpus
made in memory): index caches are keyed by it, so an edited file never meets an old index.

Host-only module: no jax.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Union

__all__ = ["CorpusError", "Passage", "Corpus", "load_corpus"]


class CorpusError(ValueError):
    """The corpus is empty or a line of its file is not a passage; the message says where."""


@dataclasses.dataclass(frozen=True)
class Passage:
    id: str
    text: str
    title: Optional[str] = None

    @property
    def contents(self) -> str:
        """What the retrievers index and embed: the title (when there is one) on its own line,
        then the text. Titles carry most of a Wikipedia passage's topic words."""
        return f"{self.title}\n{self.text}" if self.title else self.text


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus(Sequence[Passage]):
    """An immutable list of passages plus where it came from and its content hash."""

    passages: tuple
    fingerprint: str = ""  # sha256 hex of the source bytes (set by __post_init__ if empty)
    source: Optional[Path] = None  # the JSON Lines file, when loaded from one

    def __post_init__(self):
        if not self.passages:
            where = f" ({self.source})" if self.source else ""
            raise CorpusError(f"empty corpus{where}: a retriever needs at least one passage")
        if not self.fingerprint:
            object.__setattr__(self, "fingerprint", hashlib.sha256(self.to_jsonl().encode()).hexdigest())

    @classmethod
    def from_passages(cls, passages: Iterable[Union[Passage, dict, str]]) -> "Corpus":
        """From Passage objects, dicts with id/text/(title), or bare strings (id = position)."""
        out = []
        for i, p in enumerate(passages):
            if isinstance(p, str):
                p = Passage(str(i), p)
            elif isinstance(p, dict):
                p = _passage(p, f"passage {i}")
            out.append(p)
        _check_unique(out, lambda i: f"passage {i}")
        return cls(tuple(out))

    @classmethod
    def from_jsonl(cls, path: Union[str, Path]) -> "Corpus":
        """Read a JSON Lines file of {"id", "text", optional "title"} objects (blank lines are
        skipped). A malformed line is a CorpusError naming the file and line number."""
        path = Path(path).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"corpus file not found: {path}")
        raw = path.read_bytes()
        passages, lines = [], []
        for lineno, line in enumerate(raw.decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{where}: not valid JSON ({e.msg})") from None
            passages.append(_passage(obj, where))
            lines.append(lineno)
        _check_unique(passages, lambda i: f"{path}:{lines[i]}")
        return cls(tuple(passages), hashlib.sha256(raw).hexdigest(), path.resolve())

    def to_jsonl(self) -> str:
        return "".join(json.dumps({k: v for k, v in dataclasses.asdict(p).items() if v is not None},
                                  ensure_ascii=False) + "\n" for p in self.passages)

    def contents(self, i: int) -> str:
        return self.passages[i].contents

    def all_contents(self) -> list:
        return [p.contents for p in self.passages]

    def __len__(self) -> int:
        return len(self.passages)

    def __getitem__(self, i):
        return self.passages[i]

    def __iter__(self) -> Iterator[Passage]:
        return iter(self.passages)

    def __repr__(self) -> str:
        src = f", source={str(self.source)!r}" if self.source else ""
        return f"Corpus({len(self)} passages{src}, sha256={self.fingerprint[:12]}...)"


def load_corpus(corpus: Union[Corpus, str, Path]) -> Corpus:
    """A Corpus as given, or read from a JSON Lines path."""
    return corpus if isinstance(corpus, Corpus) else Corpus.from_jsonl(corpus)


def _passage(obj, where: str) -> Passage:
    if not isinstance(obj, dict):
        raise CorpusError(f"{where}: expected a JSON object with \"id\" and \"text\", got "
                          f"{type(obj).__name__}")
    missing = [f for f in ("id", "text") if f not in obj]
    if missing:
        raise CorpusError(f"{where}: missing field(s) {', '.join(missing)} (have: "
                          f"{', '.join(sorted(obj)) or 'none'})")
    pid, text, title = obj["id"], obj["text"], obj.get("title")
    if not isinstance(pid, (str, int)) or isinstance(pid, bool):
        raise CorpusError(f"{where}: \"id\" must be a string or an integer, got {pid!r}")
    if not isinstance(text, str):
        raise CorpusError(f"{where}: \"text\" must be a string, got {type(text).__name__}")
    if title is not None and not isinstance(title, str):
        raise CorpusError(f"{where}: \"title\" must be a string, got {type(title).__name__}")
    return Passage(str(pid), text, title or None)


def _check_unique(passages: Sequence[Passage], where) -> None:
    """Duplicate ids would make `corpus[i].id` ambiguous in reports; catch them at load."""
    seen = {}
    for i, p in enumerate(passages):
        if p.id in seen:
            raise CorpusError(f"{where(i)}: duplicate passage id {p.id!r} (first at {where(seen[p.id])})")
        seen[p.id] = i
