"""Teacher-forced top-1 agreement with a reference answer, and where the disagreements fall
(``scripts/eval_forced_agreement.py`` runs the engines).

A configuration is run with a reference answer (dense bf16's greedy text) forced token by token
(:mod:`vllm_ext.quality.forced_tokens`): at step t its greedy choice is recorded given the
reference's first t tokens, then the reference token is written. The rate at which the choice equals
the reference token is the configuration's forced agreement; unlike a comparison of two free runs, a
disagreement at one step does not change the context of the next, so each step is judged on its own.

This module only counts: per step, the step's kind (``prefill``: the token the prompt's last chunk
samples; ``dense``, ``slow`` or ``fast``: a decode step as SFI's per-request recorder reports it),
the decode steps since the request last selected (its last slow step, or the prefill's end, which
makes SFI's first selection), the position in the answer, and how decided the reference's own
choice was (its best logit minus its second best). No torch, no vLLM.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

# bins: (label, lower bound inclusive, upper bound exclusive)
SINCE_SELECT_BINS = (("0", 0, 1), ("1", 1, 2), ("2-3", 2, 4), ("4-7", 4, 8), ("8-15", 8, 16),
                     ("16-31", 16, 32), ("32+", 32, 1 << 30))
POSITION_BINS = (("0-15", 0, 16), ("16-63", 16, 64), ("64-127", 64, 128), ("128-255", 128, 256),
                 ("256+", 256, 1 << 30))
GAP_BINS = (("<0.25", 0.0, 0.25), ("0.25-1", 0.25, 1.0), ("1-3", 1.0, 3.0), (">=3", 3.0, float("inf")))
MODES = ("prefill", "dense", "slow", "fast")


def request_modes(snapshots: Sequence[Mapping[str, Mapping]], request_id: str, n_tokens: int) -> list[str] | None:
    """The kind of each of a request's ``n_tokens`` sampling steps from the backend's per-step
    snapshots (``RequestStateTable.recorder``: per step, vLLM's internal request id -> view with
    ``is_decode`` and ``mode``). vLLM's internal id is the output's ``request_id`` with a suffix
    (``"3-8a370368"``). Token 0 is the prefill's; token t >= 1 is the t-th decode step's. None when
    the snapshots do not hold exactly ``n_tokens - 1`` decode steps of the request."""
    decode = [view["mode"] for step in snapshots for rid, view in step.items()
              if (rid == request_id or rid.startswith(request_id + "-")) and view["is_decode"]]
    if len(decode) != n_tokens - 1:
        return None
    return ["prefill"] + decode


def since_select(modes: Sequence[str]) -> list[int | None]:
    """Per step, the decode steps since the request last selected: 0 at a slow step, and counted
    from the prefill's end (SFI's first selection) before the first slow step; None for the prefill
    step itself and for dense steps (they read everything)."""
    out: list[int | None] = []
    last = None
    for t, mode in enumerate(modes):
        if mode == "prefill":
            last = t
            out.append(None)
        elif mode == "slow":
            last = t
            out.append(0)
        elif mode == "fast":
            out.append(None if last is None else t - last)
        else:
            out.append(None)
    return out


def step_rows(reference: Mapping, request: Mapping, key: str = "") -> list[dict]:
    """One row per step of one request: ``reference`` holds the forced ``tokens`` and the reference
    run's ``gap`` per step; ``request`` the forced run's ``argmax``, ``margin`` and ``modes`` (None:
    the engine ran no SFI, every decode step dense)."""
    tokens, argmax = reference["tokens"], request["argmax"]
    if len(argmax) != len(tokens):
        raise ValueError(f"{key}: {len(argmax)} recorded steps for a reference of {len(tokens)} tokens")
    modes = request.get("modes") or ["prefill"] + ["dense"] * (len(tokens) - 1)
    since = since_select(modes)
    return [dict(key=key, step=t, agree=argmax[t] == tokens[t], tie=request["margin"][t] == 0.0,
                 mode=modes[t], since_select=since[t], ref_gap=reference["gap"][t])
            for t in range(len(tokens))]


def _bin(value, bins) -> str | None:
    if value is None:
        return None
    return next(label for label, lo, hi in bins if lo <= value < hi)


def _rate(rows: list[dict], total_disagree: int) -> dict:
    n = len(rows)
    d = sum(not r["agree"] for r in rows)
    return dict(n=n, agree=(n - d) / n if n else None, disagree_n=d,
                share_of_disagreements=d / total_disagree if total_disagree else None)


def _grouped(rows: list[dict], label, order: Iterable[str], total_disagree: int) -> dict:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        g = label(r)
        if g is not None:
            groups.setdefault(g, []).append(r)
    return {g: _rate(groups[g], total_disagree) for g in order if g in groups}


def summarise(rows: list[dict]) -> dict:
    """Agreement over ``rows`` (any number of requests' :func:`step_rows`) and by group: ``agree``
    (the greedy choice is the reference token), ``agree_or_tie`` (or the reference token ties the
    best logit), per group its rate and its share of all disagreements."""
    n = len(rows)
    d = sum(not r["agree"] for r in rows)
    first: dict[str, int] = {}
    for r in rows:
        if not r["agree"] and r["key"] not in first:
            first[r["key"]] = r["step"]
    keys = {r["key"] for r in rows}
    return dict(n=n, agree=(n - d) / n if n else None, disagree_n=d,
                agree_or_tie=sum(r["agree"] or r["tie"] for r in rows) / n if n else None,
                requests=len(keys), requests_all_agree=len(keys - set(first)),
                first_disagreement=dict(sorted(first.items())),
                by_mode=_grouped(rows, lambda r: r["mode"], MODES, d),
                by_since_select=_grouped(rows, lambda r: _bin(r["since_select"], SINCE_SELECT_BINS),
                                         [b[0] for b in SINCE_SELECT_BINS], d),
                by_position=_grouped(rows, lambda r: _bin(r["step"], POSITION_BINS), [b[0] for b in POSITION_BINS], d),
                by_reference_gap=_grouped(rows, lambda r: _bin(r["ref_gap"], GAP_BINS), [b[0] for b in GAP_BINS], d),
                by_document_kind=_grouped(rows, lambda r: r["key"].split("|")[0] + "|" + r["key"].split("|")[1],
                                          sorted({"|".join(r["key"].split("|")[:2]) for r in rows}), d))
