"""Train a sentencepiece BPE tokenizer with LLaMA's settings (byte fallback, split digits) on local text.

Inputs are RedPajama files, directories or globs (the "text" field is used) or plain .txt files.
Offline; seconds for a few MB.

    python scripts/train_tokenizer.py --input corpus --vocab-size 2048 --model-prefix tokenizer
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Iterator, Sequence


import sentencepiece as spm

from llamapipe.data.redpajama import iter_documents

MAX_SENTENCE_BYTES = 4096   # sentencepiece skips longer "sentences"; lines are cut to this


def sentences(inputs: Sequence[str], json_key: str) -> Iterator[str]:
    """Non-empty lines of every document (sentencepiece's unit of training input)."""
    text_files = [i for i in inputs if i.endswith(".txt")]
    docs = (d.texts[json_key] for d in iter_documents([i for i in inputs if i not in text_files], (json_key,)))
    for path in text_files:
        yield from _lines(open(path, encoding="utf-8", errors="replace").read())
    for text in docs:
        yield from _lines(text)


def _lines(text: str) -> Iterator[str]:
    for line in text.splitlines():
        if line.strip():
            yield line.encode("utf-8")[:MAX_SENTENCE_BYTES].decode("utf-8", errors="ignore")


def train(inputs: Sequence[str], vocab_size: int, model_prefix: str, json_key: str = "text",
          max_sentences: int = 2_000_000) -> str:
    """Train and return the path of `<model_prefix>.model`."""
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(inputs, json_key), model_prefix=model_prefix, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, split_digits=True, character_coverage=0.99995,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        add_dummy_prefix=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        input_sentence_size=max_sentences, shuffle_input_sentence=True, max_sentence_length=MAX_SENTENCE_BYTES,
        num_threads=os.cpu_count() or 1, minloglevel=2)
    return model_prefix + ".model"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True, help="RedPajama files, directories, globs or .txt files")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    p.add_argument("--json-key", default="text")
    p.add_argument("--max-sentences", type=int, default=2_000_000, help="sentencepiece input_sentence_size")
    args = p.parse_args(argv)
    if args.vocab_size < 260:
        raise SystemExit(f"--vocab-size {args.vocab_size} is too small: byte fallback alone needs 259 pieces")
    try:
        path = train(args.input, args.vocab_size, args.model_prefix, args.json_key, args.max_sentences)
    except RuntimeError as e:   # sentencepiece reports e.g. a vocabulary too large for the corpus
        raise SystemExit(f"sentencepiece training failed for --vocab-size {args.vocab_size}: {e}") from None
    print(f"wrote {path} (vocab {spm.SentencePieceProcessor(model_file=path).get_piece_size()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
