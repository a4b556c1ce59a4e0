"""Dynamic vertical-slash pattern estimation, per layer and head, on every step.

A head's pattern is a set of **vertical** key positions (every later query of the same document attends
them) and **slash** offsets d = q - k (every query attends the key d tokens back). We score a few probe
queries against all keys of their document with the true softmax, sum the probabilities down columns
(vertical scores) and along diagonals (slash scores), and keep the smallest sets that hold a share `p` of
that mass (MTraining's "flex" mode, capped at `cap`) or fixed budgets; sinks and the local window are
always kept.

Packed documents: the last queries of a packed row only see the last document, so one probe window
cannot speak for the others. We probe `last_q` queries of *every* document of at least `dense_below`
tokens: its last ones, or with `probe_windows` = n the last `last_q // n` before each n-th of it (a
pattern fitted to a document's last queries keeps less of the mass of queries far from its end). Shorter
documents are cheap enough to run dense inside their own block range (the layout does that), so they need
no probe. Vertical scores land on each document's own keys; slash scores add up over windows, since
offsets are shared (one shift-invariant slash set per head). If a row holds many long documents, each
window gets `max_probe_rows // windows` probe rows so the probe stays bounded. Its buffer (B·rows·S fp32 a
head, the only large one; nothing is O(S²)) is held for a group of heads at a time, at most
PROBE_BUFFER_BYTES: every step of the estimate is per head.

One estimator for one process and for a context-parallel ring. A ring rank holds a share of the keys
(`ProbeRows.keys`) and scores every probe query against them: the softmax partials, the vertical and slash
scores and the recall's covered mass are partial sums over its keys, combined by `reduce` (all_reduce over
the ring; the identity in one process). Every rank then selects from the same numbers, so all agree on the
pattern with no broadcast. Nothing is scattered with accumulation: slash scores are gathered from each run
of contiguous keys (`slash_columns`), so the plan is deterministic on CUDA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtrain_cli.attention.documents import document_spans
from mtrain_cli.attention.settings import AttentionConfig
from mtrain_cli.attention.sparse.probe import ProbeScores, score_probes, slash_scores
from mtrain_cli.attention.sparse.probe_keys import ProbeKeys, Reduce, one_process, whole_row_keys

# Padding for index lists: larger than any position or offset, so `searchsorted` skips it.
SENTINEL = 2**30
# Index lists (and so their strides) are padded to widths of a multiple of this: what Triton's specialization of
# integer arguments distinguishes (a multiple of 16 or not), so one build of each kernel serves every batch.
LIST_ALIGN = 16
# Bytes of the probe buffer at once, at 4 an element (the torch path's fp32; the kernels' bf16 buffer takes half):
# heads are estimated in groups that fit. Llama-3.1-8B at 128K needs 128 MiB a head with 256 probe rows (all 32
# heads fit), 1 GiB with 2,048. Under 2^31 elements, the probe kernels' int32 offsets: all heads at once overflowed
# them (bench/results/probe_memory_llama3-8b_128k_h200.md).
PROBE_BUFFER_BYTES = 6 * 2**30


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Pattern:
    """Per batch row and head: sorted vertical positions and slash offsets, SENTINEL-padded.

    Positions are global (the same frame as `q_offset`/`k_offset` of the layout)."""

    vertical_BHV: torch.Tensor  # int32 key positions, ascending
    slash_BHL: torch.Tensor  # int32 offsets q - k >= 0, ascending
    recall_BH: torch.Tensor | None = None  # fp32 share of probe mass the block layout covers
    chosen_BH: torch.Tensor | None = None  # int: verticals or slashes chosen beyond the forced ones, the larger


@dataclass(frozen=True)
class FlexLimits:
    """What the flex rule keeps in each head of a layer: the smallest set holding share `keep_H` of the probe mass,
    at most `cap_H` entries beyond the forced ones (verticals and slashes alike). `width` (host) bounds every cap:
    the index lists' width, so the plan's shapes stay known without reading the device."""

    keep_H: torch.Tensor  # fp32 [H]
    cap_H: torch.Tensor  # int64 [H]
    width: int

    @staticmethod
    def fixed(settings: AttentionConfig, num_heads: int, device: torch.device) -> FlexLimits:
        """The settings' own: share p and cap in every head."""
        keep_H = torch.full((num_heads,), settings.p, dtype=torch.float32, device=device)
        return FlexLimits(keep_H, torch.full((num_heads,), settings.cap, device=device), settings.cap)

    def of_heads(self, heads: slice) -> FlexLimits:
        return FlexLimits(self.keep_H[heads], self.cap_H[heads], self.width)


def select_indices(
    score_BHN: torch.Tensor,
    forced_BHN: torch.Tensor,
    settings: AttentionConfig,
    budget: int,
    max_forced: int,
    limits: FlexLimits | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (indices, ascending and SENTINEL-padded to a width known on the host, of forced entries plus the
    top-scored ones by mass or budget; [B, H] how many were chosen beyond the forced ones).

    max_forced: a bound on forced entries per row, known to the caller (no device sync to find it); limits: the
    flex rule's per head (None: the settings' p and cap)."""
    n = score_BHN.shape[-1]
    n_forced_BH = forced_BHN.sum(-1)
    flex = settings.pattern == "flex"
    if flex and limits is None:
        limits = FlexLimits.fixed(settings, score_BHN.shape[1], score_BHN.device)
    # only the top (forced + cap or budget) entries can be kept: rank those, not the whole row. The width (and the
    # lists' strides) is a multiple of LIST_ALIGN, whatever the batch's number of long documents (4 sinks each)
    top = min(n, round_up(max_forced + (limits.width if flex else budget), LIST_ALIGN))
    ranked_BHN = torch.where(forced_BHN, torch.inf, score_BHN)
    _, order_BHT = ranked_BHN.topk(max(top, 1), dim=-1, sorted=True)
    if flex:
        mass_BHT = score_BHN.gather(-1, order_BHT)
        before_BHT = mass_BHT.cumsum(-1) - mass_BHT
        total_BH1 = score_BHN.sum(-1, keepdim=True)
        # smallest prefix reaching the head's share of the mass; zero-score entries never join
        keep_BH = ((before_BHT < limits.keep_H[:, None] * total_BH1) & (mass_BHT > 0)).sum(-1)
        count_BH = torch.maximum(keep_BH.minimum(n_forced_BH + limits.cap_H), n_forced_BH)  # cap on top of forced
    else:
        positive_BH = (ranked_BHN > 0).sum(-1)
        count_BH = torch.maximum((n_forced_BH + budget).clamp(max=n), n_forced_BH).minimum(
            torch.maximum(positive_BH, n_forced_BH)
        )
    # width `top`, a bound known on the host: reading the counts would stall the stream once per layer
    keep_BHT = torch.arange(order_BHT.shape[-1], device=score_BHN.device) < count_BH[..., None]
    # int32 keys: a radix sort takes half the passes of int64's (indices and SENTINEL fit)
    indices_BHT = torch.where(keep_BHT, order_BHT.to(torch.int32), SENTINEL).sort(-1).values
    return indices_BHT, count_BH - n_forced_BH


def choose(
    vertical_score_BHS: torch.Tensor,
    slash_score_BHS: torch.Tensor,
    rows: ProbeRows,
    settings: AttentionConfig,
    limits: FlexLimits | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Verticals (plus each long document's sinks) and slashes (plus the local window) from global scores, and
    [B, H] how many of either were chosen beyond the forced ones (the larger count)."""
    B, H, S = vertical_score_BHS.shape
    num_docs = rows.pos_BWR.shape[1] // settings.probe_windows  # the most long documents in a row
    vertical_BHV, vertical_chosen_BH = select_indices(
        vertical_score_BHS,
        rows.sink_BS[:, None].expand(B, H, S),
        settings,
        settings.num_vertical,
        num_docs * settings.num_sink,
        limits,
    )
    slash_BHL, slash_chosen_BH = select_indices(
        slash_score_BHS, rows.window_S.expand(B, H, S), settings, settings.num_slash, settings.local_window, limits
    )
    return vertical_BHV, slash_BHL, torch.maximum(vertical_chosen_BH, slash_chosen_BH)


@dataclass(frozen=True)
class ProbeRows:
    """The probe queries of a packed batch: windows of R positions in each long document (W windows per row at
    most), and the keys this process scores them against."""

    start_BS: torch.Tensor  # each token's document start
    long_BS: torch.Tensor  # token in a document of >= dense_below tokens
    end_BW: torch.Tensor  # last position of each probe window (W = most per row)
    pos_BWR: torch.Tensor  # probe positions (clamped to >= 0)
    doc_start_BW: torch.Tensor
    row_ok_BWR: torch.Tensor  # a real probe row (its window exists and lies inside its document)
    valid_BW: torch.Tensor
    pos_BQ: torch.Tensor  # the Q = W·R probe positions, window-major, -1 for rows that are not real
    lo_BQ: torch.Tensor  # their documents' first positions
    keys: ProbeKeys
    slash_col_BWKS: torch.Tensor  # columns of a window's slash masses holding offset d (see slash_columns)
    sink_BS: torch.Tensor  # the first num_sink keys of every long document (always vertical)
    window_S: torch.Tensor  # offsets of the local window (always slash)


def probe_rows(
    document_ids_BS: torch.Tensor,
    settings: AttentionConfig,
    spans: tuple[torch.Tensor, torch.Tensor] | None = None,
    keys_for: Callable[[int], ProbeKeys] | None = None,
    most_long: int | None = None,
) -> ProbeRows:
    """spans: `document_spans(document_ids_BS)`, when the caller has it already; keys_for(R): this process's
    ProbeKeys for R probe rows a window (a ring rank's share; None: the whole row's, `whole_row_keys`);
    most_long: the most documents of dense_below tokens or more in a row, when the host knows it (None: read the
    device)."""
    start_BS, length_BS = document_spans(document_ids_BS) if spans is None else spans
    S = document_ids_BS.shape[1]
    device = document_ids_BS.device
    pos_S = torch.arange(S, device=device)
    long_BS = length_BS >= settings.dense_below
    ends_long_BS = long_BS & (pos_S == start_BS + length_BS - 1)
    D = max(int(ends_long_BS.sum(1).max()) if most_long is None else most_long, 1)  # most long documents in a row
    flags_BS, order_BS = ends_long_BS.to(torch.int8).sort(dim=1, descending=True, stable=True)
    end_BD, valid_BD = order_BS[:, :D], flags_BS[:, :D].bool()
    n = settings.probe_windows
    doc_start_BD = start_BS.gather(1, end_BD)
    # window j of n ends before the (j+1)-th n-th of its document; the last one at the document's end
    span_BD1 = (end_BD - doc_start_BD + 1)[..., None]
    end_BW = (doc_start_BD[..., None] + span_BD1 * torch.arange(1, n + 1, device=device) // n - 1).reshape(-1, D * n)
    valid_BW = valid_BD.repeat_interleave(n, 1)
    doc_start_BW = doc_start_BD.repeat_interleave(n, 1)
    W = D * n
    R = max(1, min(settings.last_q // n, settings.max_probe_rows // W))
    pos_BWR = end_BW[..., None] - (R - 1) + torch.arange(R, device=device)
    row_ok_BWR = valid_BW[..., None] & (pos_BWR >= doc_start_BW[..., None])
    B = document_ids_BS.shape[0]
    pos_BQ = torch.where(row_ok_BWR, pos_BWR, -1).reshape(B, W * R)
    lo_BQ = doc_start_BW[..., None].expand(B, W, R).reshape(B, W * R)
    keys = whole_row_keys(S, settings.block_size, R, device) if keys_for is None else keys_for(R)
    sink_BS = long_BS & (pos_S < start_BS + settings.num_sink)
    return ProbeRows(
        start_BS,
        long_BS,
        end_BW,
        pos_BWR.clamp(min=0),
        doc_start_BW,
        row_ok_BWR,
        valid_BW,
        pos_BQ,
        lo_BQ,
        keys,
        slash_columns(end_BW, valid_BW, keys, S),
        sink_BS,
        pos_S < settings.local_window,
    )


def slash_columns(end_BW: torch.Tensor, valid_BW: torch.Tensor, keys: ProbeKeys, seq_len: int) -> torch.Tensor:
    """-> [B, W, K, S]: the column where window w's slash masses (ProbeScores.slash_mass) hold offset d, once per
    run of this process's keys that the offset reaches (K = keys.max_runs); column 0 where none does, a column
    that is always zero (its rows read only the R zero columns before the first run).

    At offset d the window's R rows see the R global keys [a, a + R), a = end_w - R + 1 - d. A run of keys
    starting at x in column x_c meets that range at column x_c + a - x. In one process there is one run
    (x = 0, x_c = R): column end_w + 1 - d."""
    R, K = keys.pad, keys.max_runs
    a_BWS = end_BW[..., None] - R + 1 - torch.arange(seq_len, device=end_BW.device)
    first_BWS = torch.searchsorted(keys.run_end_U, a_BWS, right=True)  # the first run ending after a
    run_BWKS = first_BWS[:, :, None] + torch.arange(K, device=end_BW.device)[:, None]
    in_range_BWKS = run_BWKS < keys.run_start_U.shape[0]
    run_BWKS = run_BWKS.clamp(max=keys.run_start_U.shape[0] - 1)
    start_BWKS = keys.run_start_U[run_BWKS]
    a_BW1S = a_BWS[:, :, None]
    ok_BWKS = in_range_BWKS & (start_BWKS < a_BW1S + R) & valid_BW[..., None, None]
    return torch.where(ok_BWKS, keys.run_column_U[run_BWKS] + a_BW1S - start_BWKS, 0)


def estimate_pattern(
    q_BHSD: torch.Tensor,
    k_BHkSD: torch.Tensor,
    document_ids_BS: torch.Tensor | None,
    scale: float,
    settings: AttentionConfig,
    rows: ProbeRows | None = None,
    reduce: Reduce = one_process,
    limits: FlexLimits | None = None,
) -> Pattern:
    """Score probe queries, pick verticals and slashes per head, and measure the probes' recall.

    rows: `probe_rows` of the batch, when the caller keeps it across layers (a ring rank: built with its key
    positions, q/k its own tokens, and `reduce` its all_reduce); limits: the flex rule's per head (None: the
    settings')."""
    B, _H, S, _D = q_BHSD.shape
    if rows is None:
        if document_ids_BS is None:
            document_ids_BS = torch.zeros(B, S, dtype=torch.long, device=q_BHSD.device)
        rows = probe_rows(document_ids_BS, settings)
    probe_BHQD = reduce(probe_queries(q_BHSD, rows))
    return estimate_from_probes(probe_BHQD, k_BHkSD, rows, scale, settings, reduce, limits)


def probe_queries(q_BHSD: torch.Tensor, rows: ProbeRows) -> torch.Tensor:
    """[B, H, W·R, D]: the probe rows' queries, window-major; zero where another process holds the query (a
    sum over the processes gathers them all)."""
    B, H, _, D = q_BHSD.shape
    W, R = rows.pos_BWR.shape[1:]
    if rows.keys.whole_row:  # one process: every probe query is here, at its own position
        return q_BHSD.gather(2, rows.pos_BWR.reshape(B, 1, W * R, 1).expand(B, H, W * R, D))
    local_BQ = rows.keys.local_of_global_S[rows.pos_BWR.reshape(B, W * R)]
    probe_BHQD = q_BHSD.gather(2, local_BQ.clamp(min=0).reshape(B, 1, W * R, 1).expand(B, H, W * R, D))
    return torch.where((local_BQ >= 0).reshape(B, 1, W * R, 1), probe_BHQD, 0.0)


def probe_statistics(
    probe_BHQD: torch.Tensor, k_BHkND: torch.Tensor, rows: ProbeRows, scale: float, reduce: Reduce = one_process
) -> tuple[ProbeScores, torch.Tensor, torch.Tensor]:
    """-> (this process's probe scores, vertical scores [B, H, S], slash scores [B, H, S]); the two score
    vectors are global (summed over the processes by `reduce`)."""
    scores = score_probes(probe_BHQD, k_BHkND, rows.pos_BQ, rows.lo_BQ, rows.keys, scale, reduce)
    slash_BHS = slash_scores(scores, rows.slash_col_BWKS, rows.pos_BQ, rows.lo_BQ)
    return scores, reduce(rows.keys.to_global(scores.vertical_BHN)), reduce(slash_BHS)


def head_group(num_heads: int, num_kv_heads: int, bytes_per_head: int) -> int:
    """The most query heads estimated at once: their probe buffer within PROBE_BUFFER_BYTES (one head at least),
    a divisor of num_heads made of whole key-head groups or a share of one, so a group reads whole key heads."""
    group = num_heads // num_kv_heads
    sizes = [n for n in range(1, num_heads + 1) if num_heads % n == 0 and (n % group == 0 or group % n == 0)]
    return max([n for n in sizes if n * bytes_per_head <= PROBE_BUFFER_BYTES], default=1)


def estimate_from_probes(
    probe_BHQD: torch.Tensor,
    k_BHkND: torch.Tensor,
    rows: ProbeRows,
    scale: float,
    settings: AttentionConfig,
    reduce: Reduce = one_process,
    limits: FlexLimits | None = None,
) -> Pattern:
    """The pattern from the probe queries (`probe_queries`, summed over the processes) and this process's keys;
    shapes depend only on the inputs' (and the limits' width). Heads go in groups (`head_group`), sized by the
    widest process's buffer row: every process of a ring takes the same groups, so their reduces pair up."""
    B, H, Q, _ = probe_BHQD.shape
    Hk = k_BHkND.shape[1]
    heads = head_group(H, Hk, B * Q * rows.keys.widest * 4)
    if heads == H:
        return _estimate_heads(probe_BHQD, k_BHkND, rows, scale, settings, reduce, limits)
    if limits is None and settings.pattern == "flex":
        limits = FlexLimits.fixed(settings, H, probe_BHQD.device)
    group = H // Hk
    parts = []
    for lo in range(0, H, heads):
        kv_heads = slice(lo // group, (lo + heads - 1) // group + 1)
        part_limits = None if limits is None else limits.of_heads(slice(lo, lo + heads))
        part = _estimate_heads(
            probe_BHQD[:, lo : lo + heads], k_BHkND[:, kv_heads], rows, scale, settings, reduce, part_limits
        )
        parts.append(part)
    return Pattern(*(torch.cat([getattr(p, f.name) for p in parts], 1) for f in dataclasses.fields(Pattern)))


def _estimate_heads(
    probe_BHQD: torch.Tensor,
    k_BHkND: torch.Tensor,
    rows: ProbeRows,
    scale: float,
    settings: AttentionConfig,
    reduce: Reduce,
    limits: FlexLimits | None,
) -> Pattern:
    scores, vertical_score_BHS, slash_score_BHS = probe_statistics(probe_BHQD, k_BHkND, rows, scale, reduce)
    vertical_BHV, slash_BHL, chosen_BH = choose(vertical_score_BHS, slash_score_BHS, rows, settings, limits)
    covered_BH = reduce(_covered_mass(scores, rows, vertical_BHV, slash_BHL, settings.block_size))
    mass_BH = vertical_score_BHS.sum(-1)
    # no probed (long) document: every row runs dense and keeps all of its attention mass
    recall_BH = torch.where(mass_BH > 0, covered_BH / mass_BH.clamp(min=1e-30), 1.0)
    return Pattern(vertical_BHV, slash_BHL, recall_BH, chosen_BH)


def slash_block_offsets(slash_BHL: torch.Tensor, num_blocks: int, block: int) -> torch.Tensor:
    """Bool [B, H, num_blocks + 1]: the block offsets the slashes cover (a slash d covers d // block and, off
    the block grid, one more); the last slot takes SENTINEL entries and stays False."""
    B, H = slash_BHL.shape[:2]
    slash_BHL = slash_BHL.long()
    lo_BHL = (slash_BHL // block).clamp(max=num_blocks)
    hi_BHL = torch.where(slash_BHL % block > 0, lo_BHL + 1, lo_BHL).clamp(max=num_blocks)
    delta_BHX = torch.zeros(B, H, num_blocks + 1, dtype=torch.bool, device=slash_BHL.device)
    delta_BHX.scatter_(2, lo_BHL, True).scatter_(2, hi_BHL, True)
    delta_BHX[..., num_blocks] = False
    return delta_BHX


def _covered_mass(
    scores: ProbeScores, rows: ProbeRows, vertical_BHV: torch.Tensor, slash_BHL: torch.Tensor, block: int
) -> torch.Tensor:
    """This process's share of the probe rows' mass inside the blocks and columns the layout will compute.

    Worked at block granularity: mass per (probe row, key tile), covered or not by the slash blocks, plus
    the mass on vertical columns outside covered blocks, read from the probe rows' probabilities."""
    B, H, Q, T = scores.block_mass_BHQT.shape
    S = rows.keys.local_of_global_S.shape[0]
    nb = -(-S // block)
    pos_BQ = rows.pos_BQ.clamp(min=0)
    delta_BHX = slash_block_offsets(slash_BHL, nb, block)
    key_block_T = rows.keys.tile_start_T.long() // block
    delta_BQT = (pos_BQ[..., None] // block - key_block_T).clamp(min=0, max=nb)
    covered_BHQT = delta_BHX.gather(2, delta_BQT.reshape(B, 1, -1).expand(B, H, -1)).view(B, H, Q, T)
    slash_mass_BH = (scores.block_mass_BHQT * covered_BHQT).sum((2, 3))

    V = vertical_BHV.shape[-1]
    real_BHV = vertical_BHV < S
    key_BHV = torch.where(real_BHV, vertical_BHV.long(), 0)
    column_BHV = rows.keys.column_of_global_S[key_BHV]  # a zero column where another process holds the key
    prob_BHQV = scores.prob_BHQC.gather(3, column_BHV[:, :, None, :].expand(B, H, Q, V)).to(slash_mass_BH.dtype)
    delta_BHQV = (pos_BQ.reshape(B, 1, Q, 1) // block - key_BHV[:, :, None, :] // block).clamp(min=0, max=nb)
    col_covered_BHQV = delta_BHX.gather(2, delta_BHQV.reshape(B, H, -1)).view(B, H, Q, V)
    key_BH1V = key_BHV[:, :, None, :]
    seen_BHQV = (key_BH1V <= rows.pos_BQ[:, None, :, None]) & (key_BH1V >= rows.lo_BQ[:, None, :, None])
    # only what the row sees: the kernels leave the rest of the buffer undefined
    counted_BHQV = seen_BHQV & ~col_covered_BHQV & real_BHV[:, :, None, :]
    vertical_mass_BH = torch.where(counted_BHQV, prob_BHQV, 0.0).sum((2, 3))
    return slash_mass_BH + vertical_mass_BH
