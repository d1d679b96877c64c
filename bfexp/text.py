"""Text for language models: dataset=text, its tokenizers, and the corpus it generates when given none.

``Text`` reads any local UTF-8 file or folder (nothing is downloaded; a folder's
files are its documents, a file's documents are its paragraphs, split at blank
lines) or, with ``path`` null, a corpus generated here from a fixed seed, so
``bfexp model=gpt dataset=text`` runs out of the box. Tokens are characters
(default: the vocabulary is the corpus's own characters) or a byte-level BPE
(Sennrich et al. 2016; GPT-2's byte-level form) trained on the corpus itself
with ``vocab_size`` tokens at most.

Samples are contiguous blocks of ``block_size + 1`` tokens of the documents
joined end to end, one block starting where the last ended: the first
``block_size`` are the input, the last ``block_size`` the targets (every token
is a target once). Held out: the last ``test_fraction`` of every document, so
the test set covers every document. Ranks split the training blocks iid
(shuffled) or by document (``partition=documents``: contiguous runs of the
documents, so each rank sees a few documents, non-iid).
"""

from __future__ import annotations

import functools
import math
import re
from collections import Counter
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import numpy as np
import torch

from bfexp.data import Dataset, RankData, partition
from bfexp.errors import ConfigError, DatasetError, number_in, text_of

__all__ = ["BytePairTokenizer", "CharTokenizer", "Text", "generated_corpus", "read_documents"]

Tokenizer = Literal["char", "bpe"]
TextPartition = Literal["iid", "documents"]

# ------------------------------------------------------------------ the generated corpus
# Short documents on a few subjects, each with its own words, so a model has something to learn at every
# scale (spelling, word order, which words go with a subject) and a split by document is non-iid.
SUBJECTS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    # subject: (nouns, verbs, adjectives)
    "garden": (("rose", "tree", "seed", "bee", "leaf", "root", "gardener", "path", "pond", "flower"),
               ("grows", "waters", "plants", "cuts", "feeds", "shades", "finds", "visits"),
               ("green", "tall", "small", "wild", "quiet", "yellow", "young", "old")),
    "harbor": (("ship", "sailor", "rope", "wave", "dock", "net", "fisher", "boat", "gull", "anchor"),
               ("pulls", "ties", "watches", "loads", "crosses", "carries", "meets", "leaves"),
               ("salty", "grey", "heavy", "long", "busy", "cold", "broken", "distant")),
    "kitchen": (("cook", "bread", "pot", "knife", "table", "soup", "oven", "spoon", "apple", "cup"),
                ("bakes", "stirs", "cuts", "serves", "cleans", "warms", "fills", "tastes"),
                ("hot", "sweet", "fresh", "clean", "round", "brown", "sharp", "full")),
    "school": (("teacher", "student", "book", "lesson", "bell", "desk", "map", "pencil", "class", "word"),
               ("reads", "writes", "learns", "asks", "answers", "draws", "counts", "opens"),
               ("bright", "new", "careful", "short", "hard", "open", "first", "patient")),
    "mountain": (("climber", "rock", "peak", "snow", "trail", "goat", "cloud", "river", "camp", "stone"),
                 ("climbs", "crosses", "follows", "reaches", "rests", "sees", "marks", "holds"),
                 ("steep", "white", "high", "narrow", "windy", "dark", "rough", "silent")),
    "market": (("seller", "buyer", "coin", "basket", "fruit", "cloth", "stall", "price", "scale", "crowd"),
               ("sells", "buys", "weighs", "counts", "offers", "carries", "shouts", "wraps"),
               ("cheap", "ripe", "red", "crowded", "early", "fair", "loud", "small")),
}
LINKS = ("and", "but", "while", "because", "so")
PLACES = ("in the morning", "at night", "near the {noun}", "by the {noun}", "after the rain", "every day")


def _sentence(rng: np.random.Generator, nouns: tuple[str, ...], verbs: tuple[str, ...],
              adjectives: tuple[str, ...]) -> str:
    """One sentence of a subject's words: subject, verb, object, sometimes a place or a second clause."""
    def pick(words: tuple[str, ...]) -> str:
        return words[int(rng.integers(len(words)))]

    def phrase() -> str:
        return f"the {pick(adjectives)} {pick(nouns)}" if rng.random() < 0.5 else f"the {pick(nouns)}"

    text = f"{phrase()} {pick(verbs)} {phrase()}"
    if rng.random() < 0.4:
        text += " " + pick(PLACES).format(noun=pick(nouns))
    if rng.random() < 0.3:
        text += f" {pick(LINKS)} {phrase()} {pick(verbs)} {phrase()}"
    return text[0].upper() + text[1:] + "."


@functools.lru_cache(maxsize=4)
def generated_corpus(documents: int = 48, sentences: int = 24, seed: int = 0) -> tuple[str, ...]:
    """``documents`` short documents, subject by subject (document d is about subject d * S // documents of
    S), each a title line and ``sentences`` sentences in paragraphs of four: the same text for one seed on every
    machine (numpy's PCG64 stream)."""
    rng = np.random.default_rng(seed)
    names = list(SUBJECTS)
    out = []
    for d in range(documents):
        subject = names[d * len(names) // documents]
        lines = [f"On the {subject}, part {d + 1}."]
        for start in range(0, sentences, 4):
            lines.append(" ".join(_sentence(rng, *SUBJECTS[subject]) for _ in range(min(4, sentences - start))))
        out.append("\n".join(lines) + "\n")
    return tuple(out)


# ------------------------------------------------------------------ tokenizers


class CharTokenizer:
    """One token per character; the vocabulary is the corpus's characters in code point order."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        return np.fromiter((self.index[c] for c in text), dtype=np.int64, count=len(text))

    def decode(self, ids: Any) -> str:
        return "".join(self.chars[int(i)] for i in ids)


# Words with their leading space, runs of punctuation, runs of white space (GPT-2's split, simplified): merges
# never cross these pieces, which keeps training to the distinct pieces and their counts.
PIECES = re.compile(r" ?\w+| ?[^\s\w]+|\s+")


class BytePairTokenizer:
    """Byte-level BPE trained on the corpus: start from the bytes the corpus holds, then merge the most frequent
    adjacent pair (ties: the pair first reached in (count, ids) order, so training is deterministic) until
    ``vocab_size`` tokens or no pair occurs twice. Encoding applies the merges in the order they were learnt.

    Training recounts pairs over the corpus's distinct pieces per merge (0.24 s for the generated corpus at 512
    tokens): small corpora; a large, varied one wants a library tokenizer."""

    def __init__(self, text: str, vocab_size: int) -> None:
        counts = Counter(PIECES.findall(text))
        present = sorted({b for piece in counts for b in piece.encode("utf-8")})
        self.tokens: list[bytes] = [bytes([b]) for b in present]  # id -> the bytes it stands for
        byte_id = {b: i for i, b in enumerate(present)}
        words = [([byte_id[b] for b in piece.encode("utf-8")], n) for piece, n in counts.items()]
        self.ranks: dict[tuple[int, int], int] = {}  # pair -> the id of its merge
        while len(self.tokens) < vocab_size:
            pairs: Counter = Counter()
            for ids, n in words:
                for pair in zip(ids, ids[1:]):
                    pairs[pair] += n
            if not pairs:
                break
            pair, n = max(pairs.items(), key=lambda item: (item[1], -item[0][0], -item[0][1]))
            if n < 2:
                break
            new = len(self.tokens)
            self.ranks[pair] = new
            self.tokens.append(self.tokens[pair[0]] + self.tokens[pair[1]])
            words = [(_merge(ids, pair, new), n) for ids, n in words]
        self.byte_id = byte_id
        self._cache: dict[str, list[int]] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def _piece(self, piece: str) -> list[int]:
        ids = [self.byte_id[b] for b in piece.encode("utf-8")]
        while len(ids) > 1:
            pair = min(zip(ids, ids[1:]), key=lambda p: self.ranks.get(p, math.inf))
            if pair not in self.ranks:
                break
            ids = _merge(ids, pair, self.ranks[pair])
        return ids

    def encode(self, text: str) -> np.ndarray:
        out: list[int] = []
        for piece in PIECES.findall(text):
            if piece not in self._cache:
                self._cache[piece] = self._piece(piece)
            out.extend(self._cache[piece])
        return np.array(out, dtype=np.int64)

    def decode(self, ids: Any) -> str:
        return b"".join(self.tokens[int(i)] for i in ids).decode("utf-8", errors="replace")


def _merge(ids: list[int], pair: tuple[int, int], new: int) -> list[int]:
    """``ids`` with every non-overlapping occurrence of ``pair``, left to right, replaced by ``new``."""
    out, i = [], 0
    while i < len(ids):
        if i + 1 < len(ids) and ids[i] == pair[0] and ids[i + 1] == pair[1]:
            out.append(new)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


# ------------------------------------------------------------------ reading and tokenizing a corpus


def _files(root: Path) -> list[Path]:
    """A folder's regular files at any depth, hidden ones left out, in name order: its documents."""
    return sorted(p for p in root.rglob("*") if p.is_file() and not any(part.startswith(".")
                                                                        for part in p.relative_to(root).parts))


def read_documents(path: str | None, documents: int) -> tuple[str, ...]:
    """The corpus's documents: a folder's files, a file's paragraphs (split at blank lines), or the
    generated corpus (``path`` null)."""
    if path is None:
        return generated_corpus(documents)
    root = Path(path).expanduser()
    allowed = "a UTF-8 text file or a folder of them"
    if root.is_dir():
        docs = tuple(text_of(f, "dataset.path", allowed, DatasetError) for f in _files(root))
    else:
        docs = tuple(p for p in re.split(r"\n\s*\n", text_of(root, "dataset.path", allowed, DatasetError)) if p.strip())
    return tuple(d for d in docs if d)


@functools.lru_cache(maxsize=4)
def _tokenized(source: tuple, tokenizer: str, vocab_size: int) -> tuple[tuple[np.ndarray, ...], int]:
    """(each document's token ids, the vocabulary's size), cached by source (its files' names, sizes and
    times): the driver and every virtual rank of a process tokenize once."""
    docs = read_documents(source[0], source[1])
    text = "".join(docs)
    coder = CharTokenizer(text) if tokenizer == "char" else BytePairTokenizer(text, vocab_size)
    return tuple(coder.encode(d) for d in docs), coder.vocab_size


def _blocks(docs: list[np.ndarray], block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of ``block_size + 1`` tokens of the documents joined end to end (each block starts at the
    previous one's last token), and the document each block starts in."""
    stream = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
    owner = np.repeat(np.arange(len(docs)), [len(d) for d in docs])
    count = max(0, (len(stream) - 1) // block_size)
    starts = np.arange(count) * block_size
    blocks = stream[starts[:, None] + np.arange(block_size + 1)] if count else np.zeros((0, block_size + 1), np.int64)
    return blocks, owner[starts]


# ------------------------------------------------------------------ the data set


class Text(Dataset):
    """Any local UTF-8 text (or the generated corpus) as blocks of tokens for a language model (model=gpt)."""

    name: ClassVar[str] = "text"
    tokens: ClassVar[bool] = True

    def __init__(self, path: str | None = None, tokenizer: Tokenizer = "char", vocab_size: int = 512,
                 block_size: int = 64, test_fraction: float = 0.1, partition: TextPartition = "iid",
                 eval_samples: int = 128, documents: int = 48) -> None:
        if tokenizer not in get_args(Tokenizer):
            raise ConfigError(f"dataset.tokenizer={tokenizer!r}; allowed: {', '.join(get_args(Tokenizer))}")
        if partition not in get_args(TextPartition):
            raise ConfigError(f"dataset.partition={partition!r}; allowed: {', '.join(get_args(TextPartition))}")
        number_in("dataset.vocab_size", vocab_size, low=2, integer=True, note="(bpe: the most tokens it learns)")
        number_in("dataset.block_size", block_size, low=1, integer=True)
        number_in("dataset.test_fraction", test_fraction, low=0, high=1, low_open=True, high_open=True)
        number_in("dataset.documents", documents, low=1, integer=True, note="(the generated corpus's, path=null)")
        super().__init__(eval_samples=eval_samples)
        self.partition = partition
        self.tokenizer, self.vocab_size, self.block_size = tokenizer, vocab_size, block_size
        self.test_fraction, self.documents = test_fraction, documents
        self.path = None if path is None else str(Path(path).expanduser())
        if self.path is not None:
            root = Path(self.path)
            if not root.exists() or (root.is_dir() and not _files(root)):
                raise DatasetError(f"dataset.path={path!r} {'holds no files' if root.exists() else 'does not exist'}; "
                                   "allowed: a UTF-8 text file, a folder of them, or null (the generated corpus)")

    def _source(self) -> tuple:
        """What the tokenized corpus is cached by: the path and its files' sizes and times, or the generator's."""
        if self.path is None:
            return None, self.documents
        root = Path(self.path)
        files = _files(root) if root.is_dir() else [root]
        return self.path, 0, tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)

    def _split(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
        """(training blocks, their documents, held-out blocks, held-out documents, vocabulary size)."""
        docs, vocab = _tokenized(self._source(), self.tokenizer, self.vocab_size)
        cuts = [int(round(len(d) * (1 - self.test_fraction))) for d in docs]
        train, train_doc = _blocks([d[:c] for d, c in zip(docs, cuts)], self.block_size)
        test, test_doc = _blocks([d[c:] for d, c in zip(docs, cuts)], self.block_size)
        where = f"dataset.path={self.path!r}" if self.path else f"the generated corpus (dataset.documents={self.documents})"
        for blocks, part in ((train, "training"), (test, "held-out")):
            if len(blocks) == 0:
                raise DatasetError(f"{where} leaves no {part} block of dataset.block_size={self.block_size} + 1 "
                                   f"tokens (dataset.test_fraction={self.test_fraction}); allowed: more text, a "
                                   "smaller block_size, or another test_fraction")
        return train, train_doc, test, test_doc, vocab

    def _shards(self, documents: np.ndarray, size: int, seed: int) -> list[np.ndarray]:
        """Each rank's training blocks: shuffled (iid), or contiguous runs of documents (``documents``)."""
        how = "iid" if self.partition == "iid" else "sorted"  # the blocks are in document order already
        return partition(documents, size, how, 1.0, np.random.default_rng([seed, 1]))

    def _held_out(self, count: int) -> np.ndarray:
        """The held-out blocks every rank evaluates: ``eval_samples`` of them evenly spaced over the documents."""
        if not self.eval_samples or self.eval_samples >= count:
            return np.arange(count)
        return np.unique(np.linspace(0, count - 1, self.eval_samples).round().astype(np.int64))

    def load(self, rank: int, size: int, seed: int) -> RankData:
        train, train_doc, test, _, vocab = self._split()
        mine = self._shards(train_doc, size, seed)[rank]
        test = test[self._held_out(len(test))]
        return RankData(torch.from_numpy(np.ascontiguousarray(train[mine, :-1])),
                        torch.from_numpy(np.ascontiguousarray(train[mine, 1:])),
                        torch.from_numpy(np.ascontiguousarray(test[:, :-1])),
                        torch.from_numpy(np.ascontiguousarray(test[:, 1:])),
                        vocab, len(train), tokens=True)

    def sizes(self, size: int, seed: int) -> tuple[list[int], int]:
        train, train_doc, test, _, _ = self._split()
        return [len(s) for s in self._shards(train_doc, size, seed)], len(self._held_out(len(test)))

    def sample_shape(self) -> tuple[tuple[int, ...], int]:
        return (self.block_size,), _tokenized(self._source(), self.tokenizer, self.vocab_size)[1]
