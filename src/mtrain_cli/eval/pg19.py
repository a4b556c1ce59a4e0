"""PG-19 perplexity by length, truncation protocol: at length L every book is cut to its first L tokens;
books shorter than L are skipped and counted. NLL is pooled over all predicted tokens of all books at a
length (not averaged per book); perplexity = exp(total NLL / total tokens). A second row pools only the
tokens at positions L/2..L-1: those with a long context behind them, where attention that misses far keys
(a sparse pattern) shows first. CSV + curve PNG."""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mtrain_cli.errors import UserError
from mtrain_cli.eval.haystack import json_kind, read_utf8, utf8_lines
from mtrain_cli.eval.options import EvalOptions, path_option
from mtrain_cli.eval.results import Outcome, Skip, SuiteResult
from mtrain_cli.eval.suite import Suite, SuiteRun

if TYPE_CHECKING:
    import torch

CSV_NAME = "pg19.csv"
SECOND_HALF = "perplexity, second half"
CURVE_NAME = "pg19_perplexity.png"
BOOK_SUFFIXES = (".parquet", ".jsonl", ".txt")


@dataclass
class Book:
    name: str
    text: str


_PG19_FIX = "pass PG-19 books as UTF-8 .txt files, .jsonl (one book per line with a 'text' string) or .parquet"


def _books_in_file(path: Path) -> list[Book]:
    if path.suffix not in BOOK_SUFFIXES:
        raise UserError(f"--pg19-dir: {path} is not a .parquet, .jsonl or .txt file")
    if path.suffix == ".txt":
        return [Book(path.stem, read_utf8(path, f"--pg19-dir: {path}", _PG19_FIX))]
    if path.suffix == ".jsonl":
        books = []
        for line_number, line in utf8_lines(path, f"--pg19-dir: {path}", _PG19_FIX):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UserError(
                    f"--pg19-dir: {path} line {line_number} is not json ({exc.msg} at column {exc.colno}); {_PG19_FIX}"
                ) from None
            if not isinstance(record, dict) or "text" not in record:
                what = "has no 'text' field" if isinstance(record, dict) else f"is {json_kind(record)}, not an object"
                raise UserError(
                    f"--pg19-dir: {path} line {line_number} {what}; "
                    f"PG-19 jsonl needs one book per line with a 'text' field"
                )
            if not isinstance(record["text"], str):
                raise UserError(
                    f"--pg19-dir: {path} line {line_number}: 'text' is {json_kind(record['text'])}, "
                    f"not a string; {_PG19_FIX}"
                )
            books.append(Book(str(record.get("short_book_title", f"{path.stem}:{line_number}")), record["text"]))
        return books
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"--pg19-dir: {path} could not be read as parquet ({cause}); {_PG19_FIX}") from None
    if "text" not in table.column_names:
        raise UserError(f"--pg19-dir: {path} has no 'text' column (columns: {', '.join(table.column_names)})")
    text_type = table.schema.field("text").type
    if not (pa.types.is_string(text_type) or pa.types.is_large_string(text_type)):
        raise UserError(f"--pg19-dir: {path} 'text' column holds {text_type}, not strings; {_PG19_FIX}")
    titles = table.column("short_book_title").to_pylist() if "short_book_title" in table.column_names else None
    texts = table.column("text").to_pylist()
    return [Book(titles[i] if titles else f"{path.stem}:{i}", text) for i, text in enumerate(texts) if text is not None]


def load_books(location: Path, limit: int) -> tuple[list[Book], str]:
    """The first `limit` books of a file or directory (parquet / jsonl / .txt files, sorted by name)."""
    path = location.expanduser()
    if not path.exists():
        raise UserError(f"--pg19-dir {str(location)!r} does not exist; pass a local directory (or file) of PG-19 books")
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in BOOK_SUFFIXES)
    books: list[Book] = []
    for file in files:
        books += _books_in_file(file)
        if len(books) >= limit:
            break
    if not books:
        raise UserError(
            f"--pg19-dir {str(location)!r} has no PG-19 books; pass a directory of .parquet, "
            f".jsonl (a 'text' field per line) or .txt files"
        )
    return books[:limit], f"first {min(limit, len(books))} books of {path}"


def book_tokens(tokenizer, text: str, max_length: int) -> list[int]:
    """The book's first max_length tokens, tokenising only a generous prefix of long books."""
    prefix = text[: max_length * 12]
    ids = tokenizer(prefix, add_special_tokens=True, verbose=False).input_ids  # books exceed model_max_length
    if len(ids) < max_length and len(prefix) < len(text):
        ids = tokenizer(text, add_special_tokens=True, verbose=False).input_ids
    return ids[:max_length]


def prepare_pg19(
    tokenizer, books: list[Book], lengths: list[int]
) -> tuple[list[tuple[int, str, list[int]]], dict[int, int]]:
    """([(length, book name, first `length` tokens)], books skipped as too short per length)."""
    sequences: list[tuple[int, str, list[int]]] = []
    too_short = {length: 0 for length in lengths}
    for book in books:
        ids = book_tokens(tokenizer, book.text, max(lengths))
        for length in lengths:
            if len(ids) >= length:
                sequences.append((length, book.name, ids[:length]))
            else:
                too_short[length] += 1
    return sequences, too_short


def score_pg19(
    nll_by_sequence: list[tuple[int, str, torch.Tensor]],
    lengths: list[int],
    too_short: dict[int, int],
    source: str,
    run_dir: Path,
) -> SuiteResult:
    """nll_by_sequence: (length, book, each predicted token's NLL: Runner.token_nll) for every sequence that ran."""
    pooled: dict[int, list[float]] = {}  # length -> [NLL, tokens, second half's NLL, its tokens]
    books: dict[int, int] = {}
    for length, _, nll_S1 in nll_by_sequence:
        half_S1 = nll_S1[length // 2 - 1 :]  # token i predicts position i + 1
        totals = pooled.setdefault(length, [0.0, 0, 0.0, 0])
        totals[0] += float(nll_S1.sum())
        totals[1] += nll_S1.numel()
        totals[2] += float(half_S1.sum())
        totals[3] += half_S1.numel()
        books[length] = books.get(length, 0) + 1
    perplexity = {length: math.exp(totals[0] / totals[1]) for length, totals in sorted(pooled.items())}
    second_half = {length: math.exp(totals[2] / totals[3]) for length, totals in sorted(pooled.items())}
    skipped = [
        Skip("pg19", "pg19", length, f"all {too_short[length]} books are shorter than {length} tokens")
        for length in lengths
        if length not in perplexity
    ]
    with open(run_dir / CSV_NAME, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            ["length", "perplexity", "mean_nll", "tokens", "books", "books_too_short", "second_half_perplexity"]
        )
        for length in lengths:
            if length in perplexity:
                nll, tokens = pooled[length][:2]
                writer.writerow(
                    [
                        length,
                        f"{perplexity[length]:.4f}",
                        f"{nll / tokens:.6f}",
                        int(tokens),
                        books[length],
                        too_short[length],
                        f"{second_half[length]:.4f}",
                    ]
                )
    files = [CSV_NAME]
    if perplexity:
        from mtrain_cli.eval.plots import perplexity_curve  # matplotlib

        perplexity_curve(run_dir / CURVE_NAME, list(perplexity), list(perplexity.values()), "PG-19 perplexity")
        files.append(CURVE_NAME)
    details = {
        "tokens": {str(k): int(v[1]) for k, v in pooled.items()},
        "books": {str(k): v for k, v in books.items()},
        "books_too_short": {str(k): v for k, v in too_short.items()},
    }
    rows = {"perplexity": perplexity, SECOND_HALF: second_half}
    return SuiteResult("pg19", "perplexity", rows, {"pg19": source}, skipped, details, files)


def read_pg19(options: EvalOptions) -> tuple[list[Book], str] | None:
    """The books (and where they came from), or None without --pg19-dir."""
    return None if options.pg19_dir is None else load_books(options.pg19_dir, options.samples)


def run_pg19(run: SuiteRun, books: tuple[list[Book], str] | None) -> tuple[SuiteResult, list[Outcome]]:
    from mtrain_cli.eval.runner import progress_bar

    if books is None:
        reason = "no --pg19-dir given (perplexity is measured on local PG-19 books; nothing is downloaded)"
        return SuiteResult("pg19", "perplexity", {}, {}, [Skip("pg19", "pg19", None, reason)]), []
    sequences, too_short = prepare_pg19(run.loaded.tokenizer, books[0], run.options.lengths)
    nll_by_sequence = []
    with progress_bar(run.console) as progress:
        bar = progress.add_task("pg19", total=sum(len(ids) for _, _, ids in sequences))
        run.runner.on_tokens = lambda count: progress.advance(bar, count)  # every prefill chunk
        try:
            for length, book, ids in sequences:
                nll_by_sequence.append((length, book, run.runner.token_nll(ids)))
        except KeyboardInterrupt:  # the books measured so far are kept
            run.runner.interrupted = True
        finally:
            run.runner.on_tokens = None
    return score_pg19(nll_by_sequence, run.options.lengths, too_short, books[1], run.run_dir), []


PG19_DIR = path_option("pg19_dir", "--pg19-dir", "Local PG-19 books: parquet, jsonl or .txt.")
SUITE = Suite("pg19", ("pg19",), read_pg19, run_pg19, (PG19_DIR,))
