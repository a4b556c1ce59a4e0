"""The model runner: batch 1, chunked prefill into a KV cache, greedy decoding, pooled NLL.

Full-sequence logits are never materialised: prefill runs the decoder body (no LM head) over chunks of
at most `prefill_chunk` tokens, and the LM head is applied to the last position only (generation) or to
slices of at most `head_chunk` positions in fp32 (perplexity): [head_chunk, vocab] logits at a time
instead of [S, vocab], which at 128K × 150K would be ~80 GB in fp32.

With sparse attention (a `SparseTracker`, the model loaded with mtrain's attention hook) the prompt is
prefilled in one forward: the hook runs sparse attention only when queries and keys are the same tokens, and
a later chunk would attend its cache densely. The tracker checks that every layer of every prefill really
took the sparse path and keeps each prefill's recall and density.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import DynamicCache

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
        self.head = model.get_output_embeddings()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.prefill_chunk = prefill_chunk
        self.head_chunk = head_chunk
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        self.eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if tokenizer.eos_token_id is not None:
            self.eos_ids.add(tokenizer.eos_token_id)

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
                input_ids=ids_1S[:, start : start + chunk], past_key_values=cache, use_cache=cache is not None
            ).last_hidden_state
            if on_hidden is not None:
                on_hidden(start, hidden_1CH[0])
            last_11H = hidden_1CH[:, -1:]
        if self.sparse is not None:  # fails loudly unless every layer ran sparse (e.g. a model loaded with SDPA)
            self.sparse.record_prefill(
                ids_1S.shape[1], self.sparse.sparse_calls() - sparse_before, self.model.config.num_hidden_layers
            )
        return last_11H

    @torch.inference_mode()
    def generate(self, input_ids: list[int], max_new_tokens: int) -> str:
        """Greedy continuation of `input_ids`, at most `max_new_tokens`, stopping at an EOS token."""
        cache = DynamicCache(config=self.model.config)
        hidden_11H = self.prefill(input_ids, cache)
        generated: list[int] = []
        while len(generated) < max_new_tokens:
            token = int(self.head(hidden_11H)[0, -1].argmax())
            if token in self.eos_ids:
                break
            generated.append(token)
            if len(generated) < max_new_tokens:
                step_11 = torch.tensor([[token]], device=self.device)
                hidden_11H = self.body(input_ids=step_11, past_key_values=cache, use_cache=True).last_hidden_state
        return self.tokenizer.decode(generated, skip_special_tokens=True).strip()

    @torch.inference_mode()
    def sequence_nll(self, input_ids: list[int]) -> tuple[float, int]:
        """(sum of next-token NLL in nats over positions 1..S-1, S-1 predicted tokens), logits in fp32."""
        labels_S1 = torch.tensor(input_ids[1:], device=self.device)
        weight_VH = self.head.weight.float()
        bias_V = self.head.bias.float() if getattr(self.head, "bias", None) is not None else None
        total = torch.zeros((), dtype=torch.float64, device=self.device)

        def accumulate(start: int, hidden_CH: torch.Tensor) -> None:
            nonlocal total
            for offset in range(0, hidden_CH.shape[0], self.head_chunk):
                first = start + offset  # position of this slice's first hidden state = index of its first label
                count = min(self.head_chunk, hidden_CH.shape[0] - offset, labels_S1.shape[0] - first)
                if count <= 0:  # the sequence's last position has no next token
                    return
                logits_cV = F.linear(hidden_CH[offset : offset + count].float(), weight_VH, bias_V)
                total += F.cross_entropy(logits_cV, labels_S1[first : first + count], reduction="sum").double()

        # Sparse: one forward over the whole sequence, so no cache is needed afterwards.
        cache = None if self.sparse is not None else DynamicCache(config=self.model.config)
        self.prefill(input_ids, cache, on_hidden=accumulate)
        return float(total), labels_S1.shape[0]


def progress_bar(console: Console) -> Progress:
    """Progress in tokens (prompt + generation budget), so the ETA weighs long prompts correctly."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("tokens"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
    )


def generate_all(runner: Runner, samples: list[Sample], console: Console, label: str) -> list[Outcome]:
    """Every sample through the model, greedy, scored with its task's metric."""
    outcomes: list[Outcome] = []
    total = sum(len(sample.input_ids) + sample.max_new_tokens for sample in samples)
    with progress_bar(console) as progress:
        bar = progress.add_task(label, total=total)
        for sample in samples:
            prediction = runner.generate(sample.input_ids, sample.max_new_tokens)
            outcomes.append(Outcome(sample, prediction, score(sample.metric, prediction, sample.references)))
            progress.advance(bar, len(sample.input_ids) + sample.max_new_tokens)
    return outcomes
