"""The model runner: chunked prefill into a KV cache, greedy decoding of a batch of prompts, pooled NLL.

Full-sequence logits are never materialised: prefill runs the decoder body (no LM head) over chunks of
at most `prefill_chunk` tokens, and the LM head is applied to the last position only (generation) or to
slices of at most `head_chunk` positions in fp32 (perplexity): [head_chunk, vocab] logits at a time
instead of [S, vocab], which at 128K × 150K would be ~80 GB in fp32.

With sparse attention (a `SparseTracker`, the model loaded with mtrain's attention hook) the prompt is
prefilled in one forward: the hook runs sparse attention only when queries and keys are the same tokens, and
a later chunk would attend its cache densely. The tracker checks that every layer of every prefill really
took the sparse path and keeps each prefill's recall and density.

Generation batches the decoding, not the prefill: each prompt is prefilled alone (so a prompt's prefill, and
its sparse plan, is what it would be at batch 1), then the prompts' caches are left-padded into one batch that
decodes one token a step for all: a decoding step of a small model costs little more for B prompts than for
one (bench/bench_eval_decode.py). Answers can differ from batch 1's only where padding changes the
floating-point order of a reduction and two candidate tokens tie to within it.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from transformers import DynamicCache

from mtrain_cli.attention import ATTENTION_NAME
from mtrain_cli.errors import UserError
from mtrain_cli.eval.prompts import Sample
from mtrain_cli.eval.results import Outcome
from mtrain_cli.eval.scoring import score
from mtrain_cli.eval.sparse import SparseTracker


class Runner:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        prefill_chunk: int = 4096,
        head_chunk: int = 1024,
        sparse: SparseTracker | None = None,
    ):
        self.model = model.eval()
        self.sparse = sparse
        self.body = model.base_model  # the decoder stack and final norm, without the LM head
        # the KV cache argument's name: `cache` from transformers 5.24 (`past_key_values` warns, then goes in 5.40)
        forward_args = inspect.signature(type(self.body).forward).parameters
        self.cache_arg = "cache" if "cache" in forward_args else "past_key_values"
        # how a batch's left padding is masked: mtrain's hook by document ids, SDPA by transformers' attention mask
        self.mask_by_document = model.config._attn_implementation == ATTENTION_NAME
        self.head = model.get_output_embeddings()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.prefill_chunk = prefill_chunk
        self.head_chunk = head_chunk
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)
        self.on_tokens: Callable[[int], None] | None = None  # told each prefill chunk's tokens (progress)
        self.interrupted = False  # Ctrl-C stopped a suite: the run keeps what finished and stops there
        self.partial_cells: list[str] = []  # "task at length: k of n samples" for cells the stop cut short

    def prefill(
        self,
        input_ids: list[int],
        cache: DynamicCache | None,
        on_hidden: Callable[[int, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Runs `input_ids` through the body chunk by chunk (sparse: in one chunk), filling `cache` (None:
        no cache is kept, which only a single chunk allows).

        on_hidden(first position, hidden [chunk, hidden_size]) sees every chunk's final hidden states.
        -> the last position's hidden state [1, 1, hidden_size]."""
        ids_1S = torch.tensor([input_ids], device=self.device)
        chunk = ids_1S.shape[1] if self.sparse is not None else self.prefill_chunk
        assert cache is not None or chunk >= ids_1S.shape[1], "chunked prefill needs a KV cache"
        sparse_before = self.sparse.sparse_calls() if self.sparse is not None else 0
        last_11H = None
        for start in range(0, ids_1S.shape[1], chunk):
            hidden_1CH = self.body(
                input_ids=ids_1S[:, start : start + chunk], use_cache=cache is not None, **{self.cache_arg: cache}
            ).last_hidden_state
            if on_hidden is not None:
                on_hidden(start, hidden_1CH[0])
            if self.on_tokens is not None:
                self.on_tokens(hidden_1CH.shape[1])
            last_11H = hidden_1CH[:, -1:]
        if self.sparse is not None:  # fails loudly unless every layer ran sparse (e.g. a model loaded with SDPA)
            self.sparse.record_prefill(
                ids_1S.shape[1], self.sparse.sparse_calls() - sparse_before, self.model.config.num_hidden_layers
            )
        return last_11H

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: list[int]) -> list[str]:
        """Greedy continuations of `prompts`, each of at most its `max_new_tokens`, stopping at an EOS token.

        Each prompt is prefilled on its own (as at batch 1: sparse prefill stays one forward per prompt); their
        caches are left-padded into one batch, which decodes together, a row leaving when its answer ends."""
        lengths = [len(ids) for ids in prompts]
        lengths_B = torch.tensor(lengths, device=self.device)
        cache, hidden_B1H = self._prefill_batch(prompts, max(lengths))
        # valid_BS: which cached positions hold a prompt's tokens (False: its left padding)
        valid_BS = torch.arange(max(lengths), device=self.device)[None] >= (max(lengths) - lengths_B)[:, None]
        positions_B = lengths_B.clone()  # the next token's position in its own prompt
        rows = list(range(len(prompts)))  # prompt index of each batch row still decoding
        generated: list[list[int]] = [[] for _ in prompts]
        while rows:
            tokens = self.head(hidden_B1H)[:, -1].argmax(-1).tolist()
            keep = []
            for row, (prompt, token) in enumerate(zip(rows, tokens)):
                if token in self.eos_ids or len(generated[prompt]) >= max_new_tokens[prompt]:
                    continue
                generated[prompt].append(token)
                if len(generated[prompt]) < max_new_tokens[prompt]:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(rows):  # finished rows leave the batch (and its cache)
                kept = torch.tensor(keep, device=self.device)
                cache.batch_select_indices(kept)
                valid_BS, positions_B = valid_BS[kept], positions_B[kept]
                rows, tokens = [rows[r] for r in keep], [tokens[r] for r in keep]
            valid_BS = torch.cat([valid_BS, valid_BS.new_ones(len(rows), 1)], dim=1)
            padded = len({lengths[prompt] for prompt in rows}) > 1  # known on the host: no sync to ask valid_BS
            tokens_B1 = torch.tensor(tokens, device=self.device)[:, None]
            hidden_B1H = self._decode(tokens_B1, positions_B, valid_BS if padded else None, cache)
            positions_B = positions_B + 1
        return [self.tokenizer.decode(ids, skip_special_tokens=True).strip() for ids in generated]

    def _prefill_batch(self, prompts: list[list[int]], max_len: int) -> tuple[DynamicCache, torch.Tensor]:
        """Prefills each prompt alone and left-pads its cache into one batch of max_len positions: at most one
        prompt's cache exists beside the batch's (and, as the batch's cache takes its layers, one layer's copy).
        -> (the batch's cache, last hidden states [B, 1, hidden_size])."""
        keys_by_layer: list[torch.Tensor] = []  # [B, Hk, max_len, D] per layer
        values_by_layer: list[torch.Tensor] = []
        hidden = []
        for b, ids in enumerate(prompts):
            cache = DynamicCache(config=self.model.config)
            last_11H = self.prefill(ids, cache)
            if len(prompts) == 1:
                return cache, last_11H
            hidden.append(last_11H.clone())  # not a view that keeps the prompt's hidden states [1, S, H] alive
            assert not any(getattr(layer, "is_sliding", False) for layer in cache.layers), "see check_batch_size"
            for i, layer in enumerate(cache.layers):
                if b == 0:
                    shape = (len(prompts), layer.keys.shape[1], max_len, layer.keys.shape[3])
                    keys_by_layer.append(layer.keys.new_zeros(shape))
                    values_by_layer.append(layer.values.new_zeros(shape))
                keys_by_layer[i][b, :, max_len - len(ids) :] = layer.keys[0]
                values_by_layer[i][b, :, max_len - len(ids) :] = layer.values[0]
        batched = DynamicCache(config=self.model.config)
        for i in range(len(keys_by_layer)):
            batched.update(keys_by_layer[i], values_by_layer[i], i)
            keys_by_layer[i] = values_by_layer[i] = None  # the cache holds its own copy now
        return batched, torch.cat(hidden)

    def _decode(
        self, tokens_B1: torch.Tensor, positions_B: torch.Tensor, valid_BS: torch.Tensor | None, cache: DynamicCache
    ) -> torch.Tensor:
        """One decoding step of the batch: -> hidden states [B, 1, hidden_size]. valid_BS (None: no row is padded)
        masks the padded keys: SDPA through transformers' attention mask, mtrain's hook through document ids
        (padding -1, the prompt 0)."""
        masking = {}
        if valid_BS is not None:
            if self.mask_by_document:
                masking["document_ids"] = valid_BS.int() - 1
            else:
                masking["attention_mask"] = valid_BS.long()
        return self.body(
            input_ids=tokens_B1,
            position_ids=positions_B[:, None],
            use_cache=True,
            **{self.cache_arg: cache},
            **masking,
        ).last_hidden_state

    @torch.inference_mode()
    def token_nll(self, input_ids: list[int]) -> torch.Tensor:
        """[S-1] float64 on the host: the next-token NLL in nats of positions 1..S-1, logits in fp32."""
        labels_S1 = torch.tensor(input_ids[1:], device=self.device)
        weight_VH = self.head.weight.float()
        bias_V = self.head.bias.float() if getattr(self.head, "bias", None) is not None else None
        nll_S1 = torch.zeros(labels_S1.shape[0], dtype=torch.float64, device=self.device)

        def accumulate(start: int, hidden_CH: torch.Tensor) -> None:
            for offset in range(0, hidden_CH.shape[0], self.head_chunk):
                first = start + offset  # position of this slice's first hidden state = index of its first label
                count = min(self.head_chunk, hidden_CH.shape[0] - offset, labels_S1.shape[0] - first)
                if count <= 0:  # the sequence's last position has no next token
                    return
                logits_cV = F.linear(hidden_CH[offset : offset + count].float(), weight_VH, bias_V)
                nll_c = F.cross_entropy(logits_cV, labels_S1[first : first + count], reduction="none")
                nll_S1[first : first + count] = nll_c.double()

        # Sparse: one forward over the whole sequence, so no cache is needed afterwards.
        cache = None if self.sparse is not None else DynamicCache(config=self.model.config)
        self.prefill(input_ids, cache, on_hidden=accumulate)
        return nll_S1.cpu()


def check_batch_size(model: torch.nn.Module, batch_size: int) -> None:
    """Before anything runs: batches need caches that left padding can line up (no sliding-window layers)."""
    cache_layers = DynamicCache(config=model.config).layers  # what generate() fills: the model's own cache layers
    if batch_size > 1 and any(getattr(layer, "is_sliding", False) for layer in cache_layers):
        raise UserError(
            f"--batch-size {batch_size}: {type(model).__name__} has sliding-window attention layers, whose caches "
            "cannot be batched with padding; use --batch-size 1"
        )


class _LoggedProgress(Progress):
    """Progress for piped output (logs, CI), where rich draws no bar: a line when a bar starts, then one every
    `every_s` seconds, moved or not (one prompt of millions of tokens takes minutes to build), and one when it is
    done."""

    def __init__(self, console: Console, unit: str, every_s: float = 30.0):
        super().__init__(console=console, disable=True)
        self.unit, self.every_s, self.last_line = unit, every_s, {}
        self._stopped = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="progress-lines", daemon=True)

    def __enter__(self) -> _LoggedProgress:
        super().__enter__()
        self._beat.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stopped.set()
        self._beat.join()
        super().__exit__(*exc)

    def _heartbeat(self) -> None:
        while not self._stopped.wait(self.every_s / 4):
            for task in list(self.tasks):
                if not task.finished and time.monotonic() - self.last_line.get(task.id, 0.0) >= self.every_s:
                    self._line(task.id)

    def add_task(self, description: str, *args, **kwargs) -> TaskID:
        task_id = super().add_task(description, *args, **kwargs)
        self._line(task_id)
        return task_id

    def advance(self, task_id: TaskID, advance: float = 1) -> None:
        super().advance(task_id, advance)
        if self._task(task_id).finished or time.monotonic() - self.last_line[task_id] >= self.every_s:
            self._line(task_id)

    def _task(self, task_id: TaskID) -> Task:
        return next(task for task in self.tasks if task.id == task_id)

    def _line(self, task_id: TaskID) -> None:
        task = self._task(task_id)
        self.last_line[task_id] = time.monotonic()
        eta = f" · eta {task.time_remaining:,.0f}s" if task.time_remaining and not task.finished else ""
        self.console.print(
            f"{task.description}: {task.completed:,.0f}/{task.total:,.0f} {self.unit} · {task.elapsed or 0:,.0f}s{eta}",
            highlight=False,
        )


def progress_bar(console: Console, unit: str = "tokens") -> Progress:
    """Progress in `unit` (tokens: prompt + generation budget, so the ETA weighs long prompts correctly); lines
    instead of a bar when the output is not a terminal."""
    if not console.is_terminal:
        return _LoggedProgress(console, unit)
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn(unit),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
    )


def generate_all(
    runner: Runner, samples: list[Sample], console: Console, label: str, batch_size: int = 1
) -> list[Outcome]:
    """Every sample through the model, greedy, `batch_size` prompts decoding together, scored with its task's
    metric. Prompts are batched longest first, so a batch's prompts are of about one length (little padding) and
    a batch too large for memory fails at the start. The bar moves with every prefill chunk.

    Ctrl-C (or SIGTERM) stops it: `runner.interrupted` is set and the outcomes returned are those of every sample
    that finished; a (task, length) cell that scores fewer samples than asked is named in `runner.partial_cells`."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i].input_ids))
    predictions: dict[int, str] = {}
    total = sum(len(sample.input_ids) + sample.max_new_tokens for sample in samples)
    with progress_bar(console) as progress:
        bar = progress.add_task(label, total=total)
        runner.on_tokens = lambda count: progress.advance(bar, count)
        try:
            for start in range(0, len(order), batch_size):
                batch = order[start : start + batch_size]
                answers = runner.generate(
                    [samples[i].input_ids for i in batch], [samples[i].max_new_tokens for i in batch]
                )
                predictions.update(zip(batch, answers))
                progress.advance(bar, sum(samples[i].max_new_tokens for i in batch))  # the prompts advanced it
        except KeyboardInterrupt:
            runner.interrupted = True
        finally:
            runner.on_tokens = None
    cells: dict[tuple[str, int], list[int]] = {}
    for i, sample in enumerate(samples):
        cells.setdefault((sample.task, sample.length), []).append(i)
    for (task, length), members in cells.items():
        done = sum(m in predictions for m in members)
        if 0 < done < len(members):
            runner.partial_cells.append(f"{task} at {length}: {done} of {len(members)} samples")
    return [
        Outcome(samples[i], predictions[i], score(samples[i].metric, predictions[i], samples[i].references))
        for i in sorted(predictions)
    ]
