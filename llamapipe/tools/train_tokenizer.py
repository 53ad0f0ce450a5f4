"""Train a small tokenizer on local text: sentencepiece BPE with LLaMA 1/2's settings (byte fallback, split
digits), or with --tokenizer-type HuggingFaceTokenizer a byte-level BPE `tokenizer.json` in LLaMA 3's style
(its pre-tokenizer regex, <|begin_of_text|> / <|end_of_text|> as the last ids).

Inputs are RedPajama files, directories or globs (the "text" field is used) or plain .txt files.
Offline; seconds for a few MB.

    llamapipe train-tokenizer --input corpus --vocab-size 2048 --model-prefix runs/tokenizer
    llamapipe train-tokenizer --input corpus --vocab-size 4096 --model-prefix runs/bpe \
        --tokenizer-type HuggingFaceTokenizer
"""
from __future__ import annotations

import json
import os
import sys
from typing import Iterator, Sequence

import sentencepiece as spm
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from llamapipe.training.flag_parser import FlagParser
from llamapipe.core.logger import get_logger
from llamapipe.safe_files import check_target, replace_atomically
from llamapipe.data.redpajama import iter_documents
from llamapipe.data.tokenizer import SENTENCEPIECE_TYPES, build_tokenizer

MAX_SENTENCE_BYTES = 4096   # sentencepiece skips longer "sentences"; lines are cut to this
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# LLaMA 3's pre-tokenizer split (tiktoken's cl100k pattern): contractions, words, 1-3 digit groups, punctuation.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
MIN_VOCAB = {"sentencepiece": 260, "bpe": 258}   # byte fallback: 256 + unk/bos/eos + 1; byte-level: 256 + bos/eos


def documents(inputs: Sequence[str], json_key: str) -> Iterator[str]:
    """Each .txt file's whole text, then every document's text."""
    text_files = [i for i in inputs if i.endswith(".txt")]
    for path in text_files:
        with open(path, encoding="utf-8", errors="replace") as f:
            yield f.read()
    for doc in iter_documents([i for i in inputs if i not in text_files], (json_key,)):
        yield doc.texts[json_key]


def sentences(inputs: Sequence[str], json_key: str) -> Iterator[str]:
    """Non-empty lines of every document (sentencepiece's unit of training input)."""
    for text in documents(inputs, json_key):
        yield from _lines(text)


def _lines(text: str) -> Iterator[str]:
    for line in text.splitlines():
        if line.strip():
            yield line.encode("utf-8")[:MAX_SENTENCE_BYTES].decode("utf-8", errors="ignore")


def train(inputs: Sequence[str], vocab_size: int, model_prefix: str, json_key: str = "text",
          max_sentences: int = 2_000_000) -> str:
    """Train sentencepiece and return the path of `<model_prefix>.model`."""
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    for suffix in (".model", ".vocab"):     # sentencepiece writes them by name: refuse a planted link first
        check_target(model_prefix + suffix)
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(inputs, json_key), model_prefix=model_prefix, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=True, split_digits=True, character_coverage=0.99995,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        add_dummy_prefix=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
        input_sentence_size=max_sentences, shuffle_input_sentence=True, max_sentence_length=MAX_SENTENCE_BYTES,
        num_threads=os.cpu_count() or 1, minloglevel=2)
    return model_prefix + ".model"


def train_bpe(inputs: Sequence[str], vocab_size: int, out_dir: str, json_key: str = "text") -> str:
    """Train a byte-level BPE; writes `out_dir/tokenizer.json` and a `tokenizer_config.json` naming bos/eos
    (so transformers' AutoTokenizer reads the directory too) and returns the directory."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 2, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(documents(inputs, json_key), trainer)
    tok.add_special_tokens([BOS, EOS])   # after the merges, as in LLaMA 3 (128000, 128001)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, tok.token_to_id(BOS))])])
    os.makedirs(out_dir, exist_ok=True)
    with replace_atomically(os.path.join(out_dir, "tokenizer.json"), "w") as f:    # never through a link
        f.write(tok.to_str())
    config = {"bos_token": BOS, "eos_token": EOS, "tokenizer_class": "PreTrainedTokenizerFast",
              "clean_up_tokenization_spaces": False}
    with replace_atomically(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir


def main(argv=None) -> int:
    p = FlagParser(prog="llamapipe train-tokenizer", description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="+", required=True, help="RedPajama files, directories, globs or .txt files")
    p.add_argument("--tokenizer-type", default="SentencePieceTokenizer",
                   choices=SENTENCEPIECE_TYPES + ("HuggingFaceTokenizer",))
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--model-prefix", required=True, help="sentencepiece: writes PREFIX.model and PREFIX.vocab; "
                   "HuggingFaceTokenizer: the directory PREFIX/ with tokenizer.json and tokenizer_config.json")
    p.add_argument("--json-key", default="text")
    p.add_argument("--max-sentences", type=int, default=2_000_000, help="sentencepiece input_sentence_size")
    args = p.parse_args(argv)
    kind = "bpe" if args.tokenizer_type == "HuggingFaceTokenizer" else "sentencepiece"
    if args.vocab_size < MIN_VOCAB[kind]:
        raise SystemExit(f"--vocab-size {args.vocab_size} is too small for --tokenizer-type {args.tokenizer_type}: "
                         f"its byte tokens and special tokens alone need {MIN_VOCAB[kind]}")
    log = get_logger()
    if kind == "bpe":
        path = train_bpe(args.input, args.vocab_size, args.model_prefix, args.json_key)
        log.info(f"wrote {path}/tokenizer.json and tokenizer_config.json (vocab {build_tokenizer(path).vocab_size})")
        return 0
    try:
        path = train(args.input, args.vocab_size, args.model_prefix, args.json_key, args.max_sentences)
    except RuntimeError as e:   # sentencepiece reports e.g. a vocabulary too large for the corpus
        raise SystemExit(f"sentencepiece training failed for --vocab-size {args.vocab_size}: {e}") from None
    log.info(f"wrote {path} (vocab {spm.SentencePieceProcessor(model_file=path).get_piece_size()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
