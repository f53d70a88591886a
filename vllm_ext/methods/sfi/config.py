"""SFI's section of the configuration (``speedsfi.sfi``; ALGORITHMS.md §1) and the limits its kernels
set on it. Imports neither vLLM nor torch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from vllm_ext.config_fields import ConfigError, in_unit, non_negative, positive


MAX_SELECT_SPAN = 32
MAX_PAGE_SIZE = 256
MAX_QUEST_RERANK = 16
MAX_COPY_NGRAM = 8                    # copy_ngram: tail tokens compared (unrolled in the match kernel)
DEFAULT_COPY_NGRAM = 2                # copy_ngram unset, where the trigger applies (SfiConfig.resolved_copy_ngram)
MAX_SENTENCE_COOLDOWN = 1 << 20       # the per-slot trigger state packs it with one flag in an int32


# sfi.maintenance_rows unset: the slow-step scratch may take this much (docs/sfi.md, "Slow-row
# maintenance in chunks"), and never fewer rows than the floor
MAINTENANCE_BUDGET_BYTES = 1 << 30
MIN_MAINTENANCE_ROWS = 16


def maintenance_row_bytes(*, num_heads: int, num_kv_heads: int, max_len: int, ring_slots: int) -> int:
    """The slow-step scratch of one maintenance row, fp32 over ``max_len`` positions: the ring's
    ``ring_slots`` evidence and key-norm rows per KV head, the evidence scores per query head and the
    selector's score row per KV head (its smaller tables left out)."""
    return 4 * max_len * ((2 * ring_slots + 1) * num_kv_heads + num_heads)


def auto_maintenance_rows(*, num_heads: int, num_kv_heads: int, max_len: int, ring_slots: int) -> int:
    """``sfi.maintenance_rows`` when unset: the rows :data:`MAINTENANCE_BUDGET_BYTES` of scratch hold,
    at least :data:`MIN_MAINTENANCE_ROWS` (a short ``max_model_len`` gets one chunk for large batches;
    a long one keeps its scratch near the budget)."""
    row = maintenance_row_bytes(num_heads=num_heads, num_kv_heads=num_kv_heads, max_len=max_len,
                                ring_slots=ring_slots)
    return max(MIN_MAINTENANCE_ROWS, MAINTENANCE_BUDGET_BYTES // max(row, 1))


@dataclass(frozen=True)
class SfiConfig:
    """SFI, slow-fast inference (ALGORITHMS.md §1)."""

    PER_REQUEST: ClassVar[tuple[str, ...]] = ("enabled", "k")      # what a request may set for itself

    enabled: bool = False
    k: int = 2048                      # selected tokens per KV head
    k_min: int = 32                    # the selector never returns fewer (when the allowed set has them)
    n_sink: int = 4
    n_recent: int = 256
    refresh: int = 32                  # a slow step at least every `refresh` decode steps
    # not in the paper: the refresh budget starts at 1 decode step and doubles at every slow step up to
    # `refresh` (slow steps at decode steps 1, 3, 7, 15, 31, then every `refresh` at most): an answer
    # looks up what it needs in its first tokens, before its first sentence ends (bench/QUALITY.md,
    # "The demo's question"). False = the paper's fixed budget.
    refresh_warmup: bool = False
    # not in the paper: a decode row runs sparse steps only once its context exceeds `min_len`
    # tokens (and the budget n_sink + k + n_recent, below which a sparse step would read
    # everything); shorter rows decode dense. Below about twice the budget a fast step reads more
    # than half the context and the slow steps cost more than that saves (bench/README.md, "The CPU
    # build on the real model"). 0 = the budget alone (the paper).
    min_len: int = 0
    w_prefill: int = 16                # prefill evidence window (last prompt queries)
    schedule: Literal["boundary", "periodic", "always_slow"] = "boundary"
    trigger_chars: tuple[str, ...] = (".", "?", "!", ";", "\n", "。", "？", "！")
    # optional guard (schedule boundary): a boundary refresh needs at least `min_boundary_gap` decode steps
    # since the last slow step (this step counted); a boundary inside the gap is dropped (0 = off)
    min_boundary_gap: int = 0
    # where a boundary refresh fires (schedule boundary), on the latest sampled token of each decode step:
    #   "sentence_end": at the step right after a trigger token (ALGORITHMS.md §1; our default);
    #   "sentence_start": a trigger token arms the request, and the refresh fires at the step after the
    #     next token that is neither a trigger nor whitespace-only (the first token of the next
    #     sentence), as the SFI authors' code does.
    fire_at: Literal["sentence_end", "sentence_start"] = "sentence_end"
    # after a trigger arms (or a sentence start fires), triggers are ignored for this many decode steps
    # (the authors' sentence cooldown, 2); 0 = off
    sentence_cooldown: int = 0
    # evidence and prior
    alpha: float = 0.5
    gamma_k: float = 0.5
    pos_power: float = 1.8
    pos_eta: float = 0.4
    pos_beta: float = -math.log(0.6) / 0.9
    w_k: float = 1.0
    w_pos: float = 0.7
    # fusion and refinement
    lambda_max: float = 0.02
    nms_radius: int = 16
    mu: float = 0.5
    cross_head_temperature: float = 2.0
    lam_x: float = 0.35
    eps: float = 1e-12
    # not in the paper: before top-K a position takes the best score of the `select_span` positions
    # before it, so a selected token brings the tokens that follow it (a multi-token value that the
    # evidence points at by its first token). 0 = the paper's selector. bench/QUALITY.md.
    select_span: int = 0
    # not in the paper: the same towards the past: a selected token brings the `select_span_back`
    # tokens before it (the start of a sentence the evidence points into). 0 = off.
    select_span_back: int = 0
    # not in the paper: of the `k` selected tokens, the prefill-end selection keeps its best
    # `keep_prefill` for the whole decode (the tokens the question pointed at), and every decode-time
    # selection chooses the other `k - keep_prefill` among the rest (a question's later answers:
    # bench/QUALITY.md, "Multi-value"). The budget, and so the retained fraction, do not change.
    # 0 = the paper's selector (each slow step replaces the whole selection).
    keep_prefill: int = 0
    # not in the paper: a decode step is also slow when the request's last `copy_ngram` tokens (the
    # step's input token included) occur earlier in its own tokens and the token that followed that
    # occurrence lies outside the sink and the recent window: the model is copying a span of its
    # context, and the next token it copies may not be in the selection made at the last slow step
    # (a 6-digit value answered with digits lost mid-value: bench/QUALITY.md, "Copying a value
    # whole"). Decided on the device from a per-request token history (one int32 per position, in
    # blocks of vLLM's KV cache: docs/per_request_memory.md). 0 = off (the paper's schedule);
    # 2..MAX_COPY_NGRAM otherwise. None (unset) = on with DEFAULT_COPY_NGRAM (2) where the trigger
    # can make a step slow, off where every decode step is slow already (schedule always_slow, or
    # refresh 1): `resolved_copy_ngram`, which is what the engine reads. On by default (ours): on
    # prompts written as a user writes them the preset lost 4 values that dense copied, over three
    # sets; copy_ngram 2 / copy_max_matches 1 / copy_once kept 3 of them whole and lost none the
    # preset kept, for about 21-26 % more slow steps and the same fast-step read (bench/QUALITY.md,
    # "Copying a value whole, on prompts written as a user writes them"). An explicit copy_ngram
    # with schedule always_slow is refused.
    copy_ngram: int | None = None
    # the copy trigger fires only when the span occurs at most this many times in the allowed set (a
    # value stated once, not a phrase the context repeats everywhere); 0 = any number of times
    copy_max_matches: int = 1
    # fire at the first step of each run of copying steps only (its slow step reselects from the
    # copying query and `select_span` brings the span's next tokens); False = at every copying step
    # (the default's reason above: with copy_once the trigger's slow steps stay +21-26 %)
    copy_once: bool = True
    # which selector a slow row runs (bench/QUALITY.md, "Quest-style page selection"):
    #   "sfi": the paper's selector (dense pass + attention evidence, prior, Soft-NMS, exclusivity);
    #   "quest": Quest-style pages (Tang et al. 2024): per `page_size` tokens the element-wise max/min
    #     of K is kept per request and layer; a selection row (a "slow" row of the schedule: with
    #     schedule periodic, `refresh` 1 = every step) scores every page by the upper bound of q.k
    #     (max over the query heads of the GQA group) instead of a dense pass, keeps the best pages
    #     up to `k` tokens per KV head and attends over sink + those pages + the recent window in the
    #     same step. The first decode step after prefill is a selection step. Needs k a multiple of
    #     page_size; schedule always_slow does not apply. With `keep_prefill` P > 0 (ours, not in
    #     either paper) the prefill end still makes SFI's selection (dense evidence of the prompt's
    #     last `w_prefill` queries, `select_span(_back)` applied) and keeps its best P tokens for the
    #     whole decode; the pages fill the other `k - P` (the question's evidence stays, each step's
    #     query finds what it copies next). Without it select_span(_back) must be 0 (they never
    #     apply to the pages). bench/QUALITY.md, "Quest pages beside SFI's kept selection". With
    #     `quest_rerank` 4 (below) the candidates' exact group attention chooses: dense accuracy at
    #     18.8 % retained on both quality models ("Exact scores of the Quest candidates").
    selector: Literal["sfi", "quest"] = "sfi"
    page_size: int = 16                # Quest page in tokens (selector quest)
    # not in Quest (ours): with selector "quest", a selection row takes the tokens of its best pages by
    # bound, `quest_rerank` times its budget, as candidates, reads their K and keeps the candidates
    # with the largest exact share of the GQA group's attention: token granular, and not
    # misled by a loose bound (bench/QUALITY.md, "Exact scores of the Quest candidates"). Costs K of
    # `quest_rerank * budget` tokens per selection besides the page scan. 0 = Quest's page selection.
    quest_rerank: int = 0
    # system
    # an optional upper bound on the requests decoding with SFI at once (beyond it requests wait in
    # vLLM's queue); None = every request of --max-num-seqs: the compact segments are vLLM's KV-cache
    # blocks (vllm_ext.methods.sfi.kv_spec, docs/per_request_memory.md)
    max_requests: int | None = None
    dual_stream: bool = True           # selector + gather on a side stream (CUDA); False = serial
    side_stream_slots: int = 4         # evidence scratch ring shared by the side stream and the layers
    # slow rows one maintenance pass (evidence, selector, gather) covers: the slow-step scratch is
    # sized by it, not by the request capacity, and a step runs its slow list in chunks of this many
    # rows, all inside the step (docs/sfi.md, "Slow-row maintenance in chunks"); None: as many as
    # MAINTENANCE_BUDGET_BYTES of scratch hold at max_model_len, at least MIN_MAINTENANCE_ROWS
    # (resolved at start-up: auto_maintenance_rows)
    maintenance_rows: int | None = None

    @property
    def copy_trigger_applies(self) -> bool:
        """Whether the copy trigger can make a decode step slow: not when every decode step is slow
        already (schedule always_slow; refresh 1, with either schedule, makes every step slow)."""
        return self.schedule != "always_slow" and self.refresh != 1

    @property
    def resolved_copy_ngram(self) -> int:
        """The copy trigger's n-gram the engine runs with (0 = off): `copy_ngram` when set, else
        DEFAULT_COPY_NGRAM where the trigger applies and 0 where it cannot (no token history, no
        KV-cache group for it, no per-step record/match launches)."""
        if self.copy_ngram is not None:
            return self.copy_ngram
        return DEFAULT_COPY_NGRAM if self.copy_trigger_applies else 0

    @property
    def prefill_end_selection(self) -> bool:
        """The prefill end makes SFI's first selection from the prompt's last `w_prefill` queries
        (always with selector "sfi"; with "quest" only for `keep_prefill`)."""
        return self.selector != "quest" or self.keep_prefill > 0

    def validate(self) -> None:
        for name in ("k", "refresh", "w_prefill", "side_stream_slots"):
            positive(f"sfi.{name}", getattr(self, name))
        if self.maintenance_rows is not None:
            positive("sfi.maintenance_rows", self.maintenance_rows)
        for name in ("k_min", "n_sink", "n_recent", "min_len", "min_boundary_gap", "sentence_cooldown", "nms_radius",
                     "select_span", "select_span_back", "keep_prefill", "mu", "lam_x", "gamma_k", "w_k", "w_pos", "pos_eta", "pos_beta"):
            non_negative(f"sfi.{name}", getattr(self, name))
        if self.select_span + self.select_span_back > MAX_SELECT_SPAN:
            raise ConfigError(f"speedsfi.sfi.select_span + sfi.select_span_back ({self.select_span} + "
                              f"{self.select_span_back}) must be <= {MAX_SELECT_SPAN} (the window's halo in "
                              "the selector's score kernel)")
        positive("sfi.page_size", self.page_size)
        non_negative("sfi.quest_rerank", self.quest_rerank)
        if self.quest_rerank > MAX_QUEST_RERANK:
            raise ConfigError(f"speedsfi.sfi.quest_rerank ({self.quest_rerank}) must be <= {MAX_QUEST_RERANK} "
                              "(candidates per budget token; the candidate buffers scale with it)")
        if self.quest_rerank and self.selector != "quest":
            raise ConfigError(f"speedsfi.sfi.quest_rerank ({self.quest_rerank}) applies to selector 'quest' "
                              f"only (got selector {self.selector!r}); set it to 0 or use selector 'quest'")
        if self.page_size > MAX_PAGE_SIZE:
            raise ConfigError(f"speedsfi.sfi.page_size ({self.page_size}) must be <= {MAX_PAGE_SIZE}")
        if self.selector not in ("sfi", "quest"):
            raise ConfigError(f"speedsfi.sfi.selector must be 'sfi' or 'quest', got {self.selector!r}")
        if self.selector == "quest":
            if self.k % self.page_size:
                raise ConfigError(f"speedsfi.sfi.k ({self.k}) must be a multiple of sfi.page_size "
                                  f"({self.page_size}) with selector 'quest' (whole pages are kept)")
            if (self.select_span or self.select_span_back) and not self.keep_prefill:
                raise ConfigError("speedsfi.sfi.select_span and select_span_back must be 0 with selector "
                                  "'quest' unless keep_prefill > 0 (the page is the unit of the decode-time "
                                  "selection; the spans apply to the kept prefill-end selection only)")
            if self.schedule == "always_slow":
                raise ConfigError("speedsfi.sfi.schedule 'always_slow' (dense decode) does not apply to "
                                  "selector 'quest'; use schedule 'periodic' with refresh 1 to select "
                                  "pages every step")
        # (an unset copy_ngram resolves to a valid value: resolved_copy_ngram; only an explicit one
        # can be refused)
        if self.copy_ngram and not 2 <= self.copy_ngram <= MAX_COPY_NGRAM:
            raise ConfigError(f"speedsfi.sfi.copy_ngram ({self.copy_ngram!r}) must be 0 (off) or 2..{MAX_COPY_NGRAM}: "
                              "the tail tokens a copy must match (1 would match almost every token)")
        non_negative("sfi.copy_max_matches", self.copy_max_matches)
        if self.copy_ngram and self.schedule == "always_slow":
            raise ConfigError(f"speedsfi.sfi.copy_ngram ({self.copy_ngram}) applies to schedules 'boundary' "
                              "and 'periodic' ('always_slow' is dense at every step already); leave it unset "
                              "or set it to 0")
        if self.k_min > self.k:
            raise ConfigError(f"speedsfi.sfi.k_min ({self.k_min}) must be <= sfi.k ({self.k})")
        if self.keep_prefill and self.keep_prefill > self.k - self.k_min:
            raise ConfigError(f"speedsfi.sfi.keep_prefill ({self.keep_prefill}) must be <= sfi.k - sfi.k_min "
                              f"({self.k} - {self.k_min}): decode-time selections keep at least k_min "
                              "tokens of their own")
        in_unit("sfi.alpha", self.alpha, closed_low=False)
        in_unit("sfi.lambda_max", self.lambda_max)
        positive("sfi.pos_power", self.pos_power)
        positive("sfi.cross_head_temperature", self.cross_head_temperature)
        positive("sfi.eps", self.eps)
        if self.max_requests is not None:
            positive("sfi.max_requests", self.max_requests)
        if self.fire_at not in ("sentence_end", "sentence_start"):
            raise ConfigError(f"speedsfi.sfi.fire_at must be 'sentence_end' or 'sentence_start', "
                              f"got {self.fire_at!r}")
        if self.sentence_cooldown > MAX_SENTENCE_COOLDOWN:
            raise ConfigError(f"speedsfi.sfi.sentence_cooldown ({self.sentence_cooldown}) must be <= "
                              f"{MAX_SENTENCE_COOLDOWN} (decode steps during which triggers are ignored)")
        if self.schedule == "boundary" and not self.trigger_chars:
            raise ConfigError("speedsfi.sfi.trigger_chars must not be empty with schedule 'boundary'")
        for c in self.trigger_chars:
            if not isinstance(c, str) or len(c) != 1:
                raise ConfigError(f"speedsfi.sfi.trigger_chars: each entry must be one character, got {c!r}")
