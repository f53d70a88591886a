"""What the backend asks of a method. A method is a package under ``vllm_ext/methods/`` with one
:class:`Method` subclass, listed once in :mod:`vllm_ext.methods.registry`; the backend, its builder,
the runner hooks and the scheduler policy call only what is declared here, and name no method.

Engine level (:class:`Method`, one per engine and enabled method):
- start-up: :meth:`Method.resolve` (its unset fields for the served model), :meth:`Method.check_engine`
  (refuse a configuration, at start-up, naming the field), :meth:`Method.register_kv_specs`,
  :meth:`Method.install_patches`, :meth:`Method.attention_kv_spec`, :meth:`Method.warm_up`;
- the scheduler and the runner's batch: :meth:`Method.scheduler_rule`, :meth:`Method.order_rows`;
- per request: :meth:`Method.slot_tables` (the method's own per-request tables, driven by the generic
  request table through :class:`vllm_ext.method_slots.MethodSlots`: they plan each step on the
  device);
- per step and KV-cache group: :meth:`Method.plan_group` (a plan the builder keeps in the metadata,
  for what depends on the group's own metadata);
- per attention layer: :meth:`Method.layer`, the method's share of that layer.

Layer level (:class:`MethodLayer`): declare its caches and buffers while the weights load, then per
step either take the whole layer, or take some rows (a trailing sub-batch of prefill rows, the
decode rows) and leave the rest to the dense path, and end the layer (e.g. join side-stream work);
warm up its kernels at start-up. A request's state is released through the method's per-request
tables (``MethodSlots.slot_released``).
Nothing on the hot path synchronises with the host unless the dense path says the host may read the
plan (:attr:`DenseRows.host_plan`), and nothing is allocated per step beyond what the kernels need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch


@dataclass(frozen=True)
class LayerGeometry:
    """One attention layer as the backend sees it."""

    layer_name: str
    layer_index: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    max_rows: int                 # --max-num-seqs
    max_len: int                  # max_model_len
    max_batched_tokens: int
    device: torch.device


@dataclass
class DenseRows:
    """The rows a layer call leaves to the dense path, as the methods narrow them down.

    ``end``: the dense path attends rows ``[start, end)``; a method that takes a trailing sub-batch
    lowers it. ``host_skip``: host flags of leading rows the dense pass leaves out (only when
    ``host_plan``: the dense path reads host facts for free, the CPU build). ``decode_owner``: the
    method that computes the step's decode rows itself (it sets ``start`` for a dense path that cuts
    its rows by range)."""

    start: int
    end: int
    host_plan: bool
    host_skip: list[bool] | None = None
    decode_owner: "MethodLayer | None" = None


class MethodLayer:
    """A method's share of one attention layer. Stateless across steps except for persistent buffers;
    every step-dependent decision is in the step's plan (``md.step.plans[name]`` or
    ``md.plans[name]``). Each hook does nothing unless the method needs it."""

    name = ""
    exclusive = False        # the method takes this layer whole; no other method has a share of it

    def prepare(self, forward_context: dict, act_dtype: torch.dtype) -> None:
        """While the weights load (before vLLM profiles memory: what is allocated here comes out of
        its budget): register cache holders in ``forward_context``, allocate persistent buffers."""

    def plan(self, md) -> Any:
        """This method's plan of the step for this layer, or ``None`` (the method does nothing in this
        layer this step)."""
        return None

    def bind(self, layer_name: str, md, plan) -> None:
        """Bind this step's tables (e.g. the method's pages of vLLM's KV cache) before the layer runs."""

    def takes_layer(self, md, plan) -> bool:
        """Whether the method computes the whole layer (K/V write included)."""
        return False

    def idle(self, md, plan) -> bool:
        """Whether the method has nothing to do in this layer this step, from host facts (asked only
        where the dense path reads them for free, the CPU build): if every method with a plan is
        idle, the layer runs as it runs with every method off."""
        return False

    def forward_layer(self, dense, layer, query, key, value, kv_cache, md, plan, output) -> torch.Tensor:
        raise NotImplementedError

    def claim_rows(self, rows: DenseRows, query, kv_cache, md, plan) -> None:
        """Narrow ``rows`` to what the dense path still attends (K/V of the step are written)."""

    def attend_claimed(self, query, kv_cache, md, plan, output, rows: DenseRows) -> None:
        """After the dense pass: compute the rows this method claimed, and its own per-step work
        (e.g. a selection at the end of a prompt)."""

    def end_layer(self, layer_name: str, md, plan) -> None:
        """After the layer (also when it raised): e.g. join side-stream work at the step's last layer."""

    def warm_up(self, kv_cache: torch.Tensor, shape, dtype: torch.dtype) -> bool:
        """Compile every kernel specialisation the step plans can reach (start-up); False when the
        layer launches none of its own."""
        return False

    def warmup_key(self) -> tuple:
        """What makes two layers' warm-ups differ (layers of equal keys warm up once)."""
        return (self.name,)


class Method:
    """A method as the engine runs it (one object per engine while the method is enabled)."""

    name = ""

    def __init__(self, config, vllm_config, *, row_counters=None) -> None:
        self.config = config                 # the engine's SpeedSfiConfig
        self.vllm_config = vllm_config       # None outside an engine (tests of the tables)
        self.row_counters = row_counters     # vllm_ext.row_counters.RowCounters when counting rows

    @staticmethod
    def enabled(config) -> bool:
        raise NotImplementedError

    @staticmethod
    def resolve(config, vllm_config):
        """The engine's configuration with this method's unset fields resolved for the served model
        (start-up, before the checks); default: as given."""
        return config

    @staticmethod
    def register_kv_specs() -> None:
        """Register the method's KV-cache spec classes with vLLM (once per process, at plugin load:
        spawned processes unpickle specs before any engine exists)."""

    @staticmethod
    def install_patches() -> None:
        """Install the method's patches of vLLM's code (listed in ``vllm_ext.vllm_patches.PATCHES``;
        inert unless an engine runs the method)."""

    def attention_kv_spec(self, spec, layer_name: str):
        """The KV-cache spec an attention layer reports with the method on (default: vLLM's)."""
        return spec

    def check_engine(self) -> None:
        """Refuse, at start-up, what this method cannot serve (``ConfigError`` naming the field)."""

    def slot_tables(self, table, context: Mapping[str, Any]):
        """The method's per-request tables (a ``MethodSlots``) for the engine's request ``table``, or
        ``None``. ``context``: what the runner knows (``tokenizer``, ``vocab_size``, ``max_model_len``)."""
        return None

    def plan_group(self, builder, cm, step) -> Any:
        """A per-group plan of the step, built by each metadata builder, or ``None``."""
        return None

    def layer(self, geometry: LayerGeometry) -> MethodLayer | None:
        """The method's share of the attention layer ``geometry``, or ``None``."""
        return None

    def owns_decode_rows(self) -> bool:
        """Whether the method's layers compute the decode rows themselves (on CUDA the delegate then
        attends only prefill rows, and a uniform decode step runs only our kernels)."""
        return False

    def tail_row(self, step) -> int | None:
        """The first row of a trailing sub-batch of prefill rows the method attends itself this step
        (in some layers), or ``None``. The builder cuts the delegate's metadata before it."""
        return None

    def warm_up(self, shape) -> None:
        """Engine-level kernels (run once per engine, not per layer) at start-up."""

    def warmup_gaps(self) -> list[str]:
        """What the start-up warm-up does not reach yet (logged: those kernels compile at first use)."""
        return []

    def keeps_full_cuda_graphs(self) -> bool:
        """Whether a uniform single-token decode step stays capturable in a FULL CUDA graph with the
        method on."""
        return True

    def breaks_uniform_decode(self, runner, num_reqs: int) -> bool:
        """Whether this step (host facts of the runner) must not replay a FULL CUDA graph."""
        return False

    def scheduler_rule(self):
        """The method's rules for vLLM's scheduler (admission bound, chunk ends, prefix-hit cut:
        ``limit_chunk``, ``limit_prefix_hit``, ``active``, ``describe_bound``), or ``None``."""
        return None

    def order_rows(self, batch, num_scheduled_tokens) -> None:
        """Reorder the runner's persistent batch after vLLM's own reordering (decode rows first)."""
