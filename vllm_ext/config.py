"""The one typed, validated configuration object of the plugin.

Read from ``--additional-config '{"speedsfi": {...}}'`` (or ``LLM(additional_config=...)``), optionally
starting from a named YAML preset (``{"speedsfi": {"preset": "sfi"}}``, a file in ``configs/``) or a
preset path; explicit fields override the preset. Field names and defaults are those of
``ALGORITHMS.md``. Every method is off unless enabled.

This module imports neither vLLM nor torch: the kernels' machines and the config tests use it as is.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

CONFIG_KEY = "speedsfi"
BACKEND_NAME = "SPEEDSFI"            # the registered attention backend (--attention-backend speedsfi)
PRESET_DIRS = (
    Path(__file__).resolve().parent / "presets",      # installed package (symlink to configs/ in the repo)
    Path(__file__).resolve().parent.parent / "configs",
)


class ConfigError(ValueError):
    """A bad ``speedsfi`` configuration. The message names the field and says why."""


def _positive(name: str, v: float) -> None:
    if not v > 0:
        raise ConfigError(f"speedsfi.{name} must be > 0, got {v!r}")


def _non_negative(name: str, v: float) -> None:
    if not v >= 0:
        raise ConfigError(f"speedsfi.{name} must be >= 0, got {v!r}")


def _in_unit(name: str, v: float, *, closed_low: bool = True) -> None:
    ok = (0 <= v <= 1) if closed_low else (0 < v <= 1)
    if not ok:
        raise ConfigError(f"speedsfi.{name} must be in {'[' if closed_low else '('}0, 1], got {v!r}")


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
    # with the largest exact share of the GQA group's attention: token granular, and no longer
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
            _positive(f"sfi.{name}", getattr(self, name))
        if self.maintenance_rows is not None:
            _positive("sfi.maintenance_rows", self.maintenance_rows)
        for name in ("k_min", "n_sink", "n_recent", "min_len", "min_boundary_gap", "sentence_cooldown", "nms_radius",
                     "select_span", "select_span_back", "keep_prefill", "mu", "lam_x", "gamma_k", "w_k", "w_pos", "pos_eta", "pos_beta"):
            _non_negative(f"sfi.{name}", getattr(self, name))
        if self.select_span + self.select_span_back > MAX_SELECT_SPAN:
            raise ConfigError(f"speedsfi.sfi.select_span + sfi.select_span_back ({self.select_span} + "
                              f"{self.select_span_back}) must be <= {MAX_SELECT_SPAN} (the window's halo in "
                              "the selector's score kernel)")
        _positive("sfi.page_size", self.page_size)
        _non_negative("sfi.quest_rerank", self.quest_rerank)
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
        _non_negative("sfi.copy_max_matches", self.copy_max_matches)
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
        _in_unit("sfi.alpha", self.alpha, closed_low=False)
        _in_unit("sfi.lambda_max", self.lambda_max)
        _positive("sfi.pos_power", self.pos_power)
        _positive("sfi.cross_head_temperature", self.cross_head_temperature)
        _positive("sfi.eps", self.eps)
        if self.max_requests is not None:
            _positive("sfi.max_requests", self.max_requests)
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


@dataclass(frozen=True)
class SpeedConfig:
    """SPEED, shallow prefill / deep decode (ALGORITHMS.md §2)."""

    enabled: bool = False
    l_cut: int | None = None           # lower layers 0..l_cut-1; None = 3/4 of the model's layers
    anchor: Literal["bos", "none"] = "bos"
    variant: Literal["speed", "self_only"] = "speed"

    def validate(self) -> None:
        if self.l_cut is not None:
            _positive("speed.l_cut", self.l_cut)

    def resolved_l_cut(self, num_layers: int) -> int:
        return self.l_cut if self.l_cut is not None else max(1, (3 * num_layers) // 4)


@dataclass(frozen=True)
class CritiPrefillConfig:
    """CritiPrefill, segment-wise criticality for prefill (ALGORITHMS.md §3)."""

    enabled: bool = False
    segment_size: int = 512
    block_size: int = 32
    budget: int = 1024                 # keys per query segment
    alpha: float = 0.25
    fusion: Literal["paper", "ema"] = "paper"
    score: Literal["paper", "code"] = "paper"
    min_len: int = 4096                # shorter prompts prefill densely
    dense_layers: tuple[int, ...] = (0,)
    # system: an optional upper bound on the prompts in a sparse prefill at once (the others wait in
    # vLLM's queue: sched.critiprefill_admission_waits). None (default): no bound of ours; each
    # prompt's state is KV-cache pages that vLLM's block manager allocates
    # (vllm_ext.methods.critiprefill.kv_spec, docs/per_request_memory.md).
    max_requests: int | None = None

    def validate(self) -> None:
        for name in ("segment_size", "block_size", "budget"):
            _positive(f"critiprefill.{name}", getattr(self, name))
        _non_negative("critiprefill.min_len", self.min_len)
        _in_unit("critiprefill.alpha", self.alpha)
        if self.max_requests is not None:
            _positive("critiprefill.max_requests", self.max_requests)
        if self.segment_size % self.block_size:
            raise ConfigError(f"speedsfi.critiprefill.segment_size ({self.segment_size}) must be a "
                              f"multiple of critiprefill.block_size ({self.block_size})")
        if self.budget % self.block_size:
            raise ConfigError(f"speedsfi.critiprefill.budget ({self.budget}) must be a multiple of "
                              f"critiprefill.block_size ({self.block_size})")
        for layer in self.dense_layers:
            _non_negative("critiprefill.dense_layers[]", layer)


@dataclass(frozen=True)
class SpeedSfiConfig:
    sfi: SfiConfig = field(default_factory=SfiConfig)
    speed: SpeedConfig = field(default_factory=SpeedConfig)
    critiprefill: CritiPrefillConfig = field(default_factory=CritiPrefillConfig)
    preset: str | None = None
    # CUDA: the kernel that attends the decode rows left dense (engine-wide). "paged_decode": ours
    # (split-K, the same launches whatever the rows decide, so a pure-decode step is one FULL CUDA
    # graph); "delegate": vLLM's Triton attention (TritonAttentionImpl, == TRITON_ATTN bit for bit).
    # "auto": paged_decode with SFI on (its dense rows are chosen on the device; the delegate cannot
    # attend a device-chosen subset), the delegate otherwise. With every method off, "paged_decode"
    # is the like-for-like dense reference of SFI (bench/vllm_e2e: SFI with a covering budget ==
    # all off through paged_decode). The CPU build's dense path is paged_reference either way.
    dense_decode: Literal["auto", "delegate", "paged_decode"] = "auto"
    # CUDA: the vLLM backend the dense rows our kernels leave go to (prefill chunks; with every
    # method off, decode too), engine-wide. "triton": TRITON_ATTN (TritonAttentionImpl). "flash_attn":
    # FLASH_ATTN (FA3 on Hopper), what `vllm serve` picks by default there: on an H200 a SPEEDSFI
    # prefill step through TRITON_ATTN looked ~4x slower than FA3's (bench/README.md, 2026-11-26).
    # Both read and write vLLM 0.32's one KV layout. The CPU build's dense path is CPU_ATTN either
    # way. "auto": the backend vLLM's own selector picks for this model, dtype and GPU (FLASH_ATTN on
    # Hopper and Ampere, TRITON_ATTN where FA cannot take it; logged at start-up; a pick SPEEDSFI
    # cannot delegate to, such as FLASHINFER, runs TRITON_ATTN, logged and counted). "flash_attn" and
    # "auto" have not yet run on a GPU: opt-in until a GPU run has checked them token for token.
    dense_delegate: Literal["auto", "triton", "flash_attn"] = "triton"

    @property
    def any_enabled(self) -> bool:
        return self.sfi.enabled or self.speed.enabled or self.critiprefill.enabled

    @property
    def resolved_dense_decode(self) -> str:
        if self.dense_decode == "auto":
            return "paged_decode" if self.sfi.enabled else "delegate"
        return self.dense_decode

    def validate(self) -> None:
        self.sfi.validate()
        self.speed.validate()
        self.critiprefill.validate()
        if self.sfi.enabled and self.dense_decode == "delegate":
            raise ConfigError("speedsfi.dense_decode = 'delegate' is not possible with SFI on: SFI's "
                              "dense rows are chosen on the device each step, and vLLM's Triton "
                              "attention cannot attend a device-chosen subset of the rows; use 'auto' "
                              "or 'paged_decode'")

    def validate_for_model(self, *, num_layers: int, max_model_len: int | None = None) -> None:
        """Checks that need the served model; called at engine start-up."""
        if self.speed.enabled:
            l_cut = self.speed.resolved_l_cut(num_layers)
            if l_cut > num_layers:
                raise ConfigError(f"speedsfi.speed.l_cut ({l_cut}) must be <= the model's number of "
                                  f"layers ({num_layers})")
        for layer in self.critiprefill.dense_layers:
            if self.critiprefill.enabled and layer >= num_layers:
                raise ConfigError(f"speedsfi.critiprefill.dense_layers: layer {layer} does not exist "
                                  f"(the model has {num_layers} layers)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_dict(cls, raw: Mapping[str, Any] | None) -> "SpeedSfiConfig":
        """Build from the ``speedsfi`` mapping (preset first, then explicit fields); validates."""
        raw = dict(raw or {})
        if not isinstance(raw, dict):
            raise ConfigError(f"speedsfi: expected a mapping, got {type(raw).__name__}")
        preset = raw.pop("preset", None)
        merged: dict[str, Any] = {}
        if preset is not None:
            if not isinstance(preset, str):
                raise ConfigError(f"speedsfi.preset must be a preset name or a path, got {preset!r}")
            merged = load_preset(preset)
        elif _enables_only(raw.get("sfi")):
            # `sfi: {enabled: true}` and nothing else: the default selection, the `sfi` preset's
            # (chosen on a real model: bench/QUALITY.md, "A real model"). Any other sfi field starts
            # from the dataclass's constants (the published method's, ALGORITHMS.md, with the copy
            # trigger on: copy_ngram unset resolves to 2 where a step can be fast).
            merged = {"sfi": dict(load_preset("sfi").get("sfi") or {})}
        _deep_update(merged, raw)
        _copy_trigger_gives_way(merged, raw)
        cfg = _build(cls, merged, "speedsfi")
        cfg = dataclasses.replace(cfg, preset=preset)
        cfg.validate()
        return cfg

    @classmethod
    def from_additional_config(cls, additional_config: Mapping[str, Any] | None) -> "SpeedSfiConfig":
        section = (additional_config or {}).get(CONFIG_KEY)
        return cls.from_dict(section)

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> "SpeedSfiConfig":
        """Per-request overrides (``SamplingParams.extra_args["speedsfi"]``), validated like the global config."""
        if not overrides:
            return self
        if "preset" in overrides:
            raise ConfigError("speedsfi.preset cannot be overridden per request")
        for name in ("dense_decode", "dense_delegate"):
            if name in overrides:
                raise ConfigError(f"speedsfi.{name} is engine-wide: it cannot be overridden per request")
        base = self.to_dict()
        base.pop("preset", None)
        _deep_update(base, dict(overrides))
        _copy_trigger_gives_way(base, overrides)
        cfg = _build(SpeedSfiConfig, base, "speedsfi")
        cfg = dataclasses.replace(cfg, preset=self.preset)
        cfg.validate()
        return cfg


# the fields a request may set for itself (SamplingParams.extra_args["speedsfi"]); every other field
# sizes buffers or plans the batch, so it is the engine's
PER_REQUEST_FIELDS = frozenset({"sfi.enabled", "sfi.k"})


def request_overrides(extra_args: Any) -> Mapping[str, Any] | None:
    """A request's ``speedsfi`` overrides: ``extra_args["speedsfi"]`` as a mapping (offline ``LLM``)
    or as its JSON text (the OpenAI server's ``vllm_xargs`` carries strings and numbers only:
    ``"vllm_xargs": {"speedsfi": "{\"sfi\": {\"k\": 256}}"}``). Raises ``ConfigError``."""
    raw = extra_args.get(CONFIG_KEY) if isinstance(extra_args, Mapping) else None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as e:
            raise ConfigError(f"speedsfi: the per-request overrides are not valid JSON ({e})") from None
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(f"speedsfi: the per-request overrides must be a mapping such as "
                          f"{{\"sfi\": {{\"k\": 256}}}}, got {type(raw).__name__}")
    return raw


def changed_fields(base: "SpeedSfiConfig", other: "SpeedSfiConfig") -> set[str]:
    """``section.field`` names whose values differ (the method sections; top-level scalars such as
    ``preset``, ``dense_decode`` and ``dense_delegate`` are not sections)."""
    changed = set()
    for section in (f.name for f in dataclasses.fields(base)):
        a, b = getattr(base, section), getattr(other, section)
        if dataclasses.is_dataclass(a):
            changed.update(f"{section}.{f.name}" for f in dataclasses.fields(a)
                           if getattr(a, f.name) != getattr(b, f.name))
    return changed


def check_request_overrides(engine: "SpeedSfiConfig", overrides: Mapping[str, Any] | None) -> "SpeedSfiConfig":
    """The configuration a request runs with, or ``ConfigError`` naming the field it cannot set:
    unknown fields, wrong types and impossible values as at start-up; engine-wide fields; SFI on a
    server started without it; a ``k`` above the engine's (which sizes the compact buffers). A ``k``
    larger than a request's context is allowed: the request decodes densely until its context
    outgrows ``n_sink + n_recent + k``."""
    if not overrides:
        return engine
    cfg = engine.with_overrides(overrides)
    # the fields the request wrote first (an engine default that gave way to one, such as the copy
    # trigger's to schedule always_slow, is not what the request asked to change)
    own = {f"{s}.{k}" for s, sec in overrides.items() if isinstance(sec, Mapping) for k in sec}
    engine_wide = sorted(changed_fields(engine, cfg) - PER_REQUEST_FIELDS, key=lambda f: (f not in own, f))
    if engine_wide:
        raise ConfigError(f"speedsfi.{engine_wide[0]} is engine-wide (set it when the server starts); a "
                          f"request can set {', '.join(sorted(PER_REQUEST_FIELDS))}")
    if cfg.sfi.enabled and not engine.sfi.enabled:
        raise ConfigError("speedsfi.sfi.enabled: this server was started without SFI (no compact "
                          "buffers); start it with speedsfi.sfi.enabled to let requests use SFI")
    if cfg.sfi.enabled and cfg.sfi.k > engine.sfi.k:
        raise ConfigError(f"speedsfi.sfi.k ({cfg.sfi.k}) must be <= the server's sfi.k ({engine.sfi.k}), "
                          f"which sizes the compact buffers")
    return cfg


def _copy_trigger_gives_way(merged: dict[str, Any], own: Mapping[str, Any]) -> None:
    """A ``copy_ngram`` the caller did not write in ``own`` (a preset's, such as the ``sfi`` preset's
    2, or the engine's under a request's overrides) is a default like ``SfiConfig``'s: where the
    trigger cannot apply (schedule ``always_slow``, ``refresh`` 1) it is dropped (unset: resolved to
    0) instead of refused or run for nothing. Only a ``copy_ngram`` the caller wrote is refused with
    ``always_slow``."""
    sfi = merged.get("sfi")
    own_sfi = own.get("sfi") if isinstance(own, Mapping) else None
    if not isinstance(sfi, dict) or (isinstance(own_sfi, Mapping) and "copy_ngram" in own_sfi):
        return
    defaults = SfiConfig()
    if sfi.get("copy_ngram") and (sfi.get("schedule", defaults.schedule) == "always_slow"
                                  or sfi.get("refresh", defaults.refresh) == 1):
        sfi["copy_ngram"] = None


def _enables_only(section: Any) -> bool:
    return isinstance(section, Mapping) and set(section) == {"enabled"} and section["enabled"] is True


def preset_names() -> list[str]:
    names = set()
    for d in PRESET_DIRS:
        if d.is_dir():
            names.update(p.stem for p in d.glob("*.yaml"))
    return sorted(names)


def load_preset(name_or_path: str) -> dict[str, Any]:
    import yaml

    path = Path(os.path.expanduser(name_or_path))
    if not (path.suffix in (".yaml", ".yml") and path.is_file()):
        path = next((d / f"{name_or_path}.yaml" for d in PRESET_DIRS if (d / f"{name_or_path}.yaml").is_file()),
                    None)
        if path is None:
            raise ConfigError(f"speedsfi.preset: no preset named {name_or_path!r} and no such YAML file; "
                              f"known presets: {', '.join(preset_names()) or '(none)'}")
    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"speedsfi.preset {path}: expected a mapping at the top level")
    data = data.get(CONFIG_KEY, data)
    if "preset" in data:
        raise ConfigError(f"speedsfi.preset {path}: presets cannot name other presets")
    return data


def _deep_update(dst: dict[str, Any], src: Mapping[str, Any]) -> None:
    for key, value in src.items():
        if isinstance(value, Mapping) and isinstance(dst.get(key), dict):
            _deep_update(dst[key], value)
        else:
            dst[key] = value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Strict conversion of a JSON/YAML value to an annotated field type."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else
                          f"{where}: expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise ConfigError(f"{where}: expected one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if isinstance(value, str) and item_tp is str:
            return tuple(value)        # "?!." -> ("?", "!", ".")
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return tuple(_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    raise TypeError(f"unhandled config type {tp} at {where}")  # a bug in this module, not user input


def _build(cls: type, raw: Any, where: str):
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), sorted(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(fields))})"
            raise ConfigError(f"{where}.{key}: unknown field{hint}")
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}")
    return cls(**kwargs)
