"""The shipped corpus: two Jane Austen novels (public domain; provenance in SOURCES.md)."""
from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent

#: corpus name -> shipped file
CORPUS_FILES: dict[str, str] = {
    "pride_and_prejudice": "pride_and_prejudice.txt",
    "persuasion": "persuasion.txt",
}
#: what ``corpus: austen`` in a run config means
CORPUS_SETS: dict[str, tuple[str, ...]] = {
    "austen": ("pride_and_prejudice", "persuasion"),
    **{name: (name,) for name in CORPUS_FILES},
}


def corpus_path(name: str) -> Path:
    if name not in CORPUS_FILES:
        raise ValueError(f"Unknown corpus file {name!r}. Allowed: {sorted(CORPUS_FILES)}")
    return DATA_DIR / CORPUS_FILES[name]


def load_corpus_bytes(corpus: str = "austen") -> bytes:
    """The raw bytes of a corpus set (documents joined by a blank line), or of a text file
    path when ``corpus`` is not a known name but an existing file."""
    if corpus in CORPUS_SETS:
        parts = [corpus_path(n).read_bytes() for n in CORPUS_SETS[corpus]]
        return b"\n\n".join(parts)
    path = Path(corpus)
    if path.is_file():
        return path.read_bytes()
    raise ValueError(f"Unknown corpus={corpus!r}. Allowed: {sorted(CORPUS_SETS)} or the path of a text file")
