"""The training corpus of the bundled model: Debian's fortune files, split into fortunes and filtered to prose."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CORPUS_DIR = Path("/usr/share/games/fortunes")

# Fortune files that are prose or verse; left out: ascii-art (pictures), perl (code), linux/linuxcookie,
# debian and knghtbrd (IRC logs full of nicknames and shell), translate-me (non-English), zippy (noise).
DEFAULT_CORPUS_FILES = (
    "art",
    "computers",
    "cookie",
    "definitions",
    "disclaimer",
    "drugs",
    "education",
    "ethnic",
    "food",
    "fortunes",
    "goedel",
    "humorists",
    "kids",
    "law",
    "literature",
    "love",
    "magic",
    "medicine",
    "men-women",
    "miscellaneous",
    "news",
    "paradoxum",
    "people",
    "pets",
    "platitudes",
    "politics",
    "pratchett",
    "riddles",
    "science",
    "songs-poems",
    "sports",
    "startrek",
    "tao",
    "wisdom",
    "work",
)

WORD_RE = re.compile(r"[A-Za-z]+")


@dataclass(frozen=True)
class Fortune:
    """One fortune cookie and the file (category) it came from."""

    category: str
    text: str


def normalize_fortune(raw: str) -> str:
    """Trims each line and collapses runs of blanks, keeping line breaks (verse needs them)."""
    lines = [re.sub(r"[ \t]+", " ", line).strip() for line in raw.splitlines()]
    return "\n".join(lines).strip()


def is_prose(text: str, max_fortune_chars: int) -> bool:
    """Keeps fortunes that read as text: not too long, mostly letters, no drawings or code."""
    if not 20 <= len(text) <= max_fortune_chars:
        return False
    letters_and_spaces = sum(1 for ch in text if ch.isalpha() or ch in " \n")
    if letters_and_spaces / len(text) < 0.8:
        return False
    return not re.search(r"[|_\\/#<>{}=~^]{3,}", text)


def load_fortunes(corpus_dir: Path, file_names: list[str], max_fortune_chars: int) -> list[Fortune]:
    """Reads the fortune files in the given (fixed) order and returns the filtered fortunes."""
    fortunes: list[Fortune] = []
    for name in file_names:
        path = corpus_dir / name
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing; install the corpus with "
                "`apt-get update && apt-get install -y fortunes-min fortunes`"
            )
        raw = path.read_text(encoding="utf-8", errors="replace")
        for chunk in re.split(r"^%\s*$", raw, flags=re.MULTILINE):
            text = normalize_fortune(chunk)
            if is_prose(text, max_fortune_chars):
                fortunes.append(Fortune(category=name, text=text))
    return fortunes


def corpus_digest(corpus_dir: Path, file_names: list[str]) -> dict[str, str]:
    """The sha256 of every corpus file, so a retrain can tell whether it saw the same data."""
    return {name: hashlib.sha256((corpus_dir / name).read_bytes()).hexdigest() for name in file_names}


def write_word_list(fortunes: list[Fortune], path: Path, min_count: int) -> int:
    """Writes the lower-cased words that occur at least min_count times in the corpus, one per line."""
    counts = Counter(word.lower() for fortune in fortunes for word in WORD_RE.findall(fortune.text))
    words = sorted(word for word, count in counts.items() if count >= min_count)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        f"# Words that occur at least {min_count} times in the hearth-tiny-llama training corpus (Debian\n"
        "# fortunes, BSD licence); written by scripts/train_tiny_model.py --word-list-out.\n" + "\n".join(words) + "\n",
        encoding="utf-8",
    )
    return len(words)
