"""An independent, unpaged decoder that applies KV eviction outside vLLM.

It is the oracle the vLLM plugin's greedy output is compared against, token
for token. It shares exactly two things with the plugin: the choice of kept
tokens (:func:`vllm_kvevict.eviction.select.choose_kept`: the policy's
scores, the head allocation, the selection) and the schedule
(:class:`EvictionSchedule`). The MomentKV correction is computed here from the
evicted tokens themselves, with the paper's uncentred formulas in fp64.
Everything else -- storage, attention, query history -- is written here from
scratch on plain per-layer tensors so that a bug in the plugin's paged storage
or kernels cannot hide in the oracle too.

Mechanism: the transformers model is loaded with a custom attention function
(registered in ``AttentionInterface``). transformers still runs the
projections and RoPE with the explicit ``position_ids`` we pass; with
``use_cache=False`` the function receives only the current step's post-RoPE
queries/keys/values, appends them to our own store keyed by
``module.layer_idx``, attends over everything stored, and then evicts.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from vllm_kvevict.config import EvictionConfig
from vllm_kvevict.eviction.select import KeepRule, choose_kept
from vllm_kvevict.moments import EvictedMoments, cross_covariance_times
from vllm_kvevict.policies.base import (
    PADDING_POSITION,
    EvictionPolicy,
    RotaryFrequencies,
    ScoringInputs,
)
from vllm_kvevict.schedule import EvictionSchedule


@dataclass
class _LayerStore:
    """The retained tokens of one layer, for one request.

    All KV heads hold the same number of tokens ``S`` (the policy keeps
    ``num_keep`` per head), so plain ``[H, S, ...]`` tensors suffice.
    """

    keys: torch.Tensor | None = None  # [H, S, D] post-RoPE
    values: torch.Tensor | None = None  # [H, S, D]
    positions: torch.Tensor | None = None  # [H, S] int64, sorted per head
    log_beta: torch.Tensor | None = None  # [H, S] fp32, the learned policy's gate output
    # [H, S] fp32, kvzip's reconstruction scores (+inf for tokens written after
    # the reconstruction pass: generated tokens are always kept)
    reconstruction: torch.Tensor | None = None
    query_history: torch.Tensor | None = None  # [Hq, t, D] post-RoPE
    query_positions: torch.Tensor | None = None  # [t] int64, sorted
    # head_pages storage: heads hold different numbers of tokens; shorter heads
    # are padded with PADDING_POSITION (after every query, so never attended).
    # The evicted tokens of each head, for the MomentKV correction.
    evicted_keys: list[torch.Tensor] | None = None  # per head [E_h, D] fp64
    evicted_values: list[torch.Tensor] | None = None
    # Per head (n, k_bar, v_bar, S_tilde) of the evicted tokens, recomputed
    # from them after each eviction (paper Eqs. 22-24, uncentred, fp64).
    moments: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] | None = None


@dataclass(frozen=True)
class _Step:
    """The step being run: positions ``[n_before, n_after)`` of the sequence."""

    n_before: int
    n_after: int
    prompt_len: int
    positions: torch.Tensor  # [T] int64


@dataclass(frozen=True)
class PromptState:
    """A prompt run once on the full cache (:meth:`ReferenceEvictingDecoder.run_prompt`):
    every layer's keys, values and last queries, and the first greedy token,
    from which any end-of-prompt eviction setting continues. ``prompt_ids``
    let kvzip's reconstruction pass run from the state; its scores are kept
    in ``reconstructions`` (per layer, by the settings they depend on) for
    the next kvzip setting on the same prompt."""

    prompt_len: int
    first_token: int
    layers: tuple[_LayerStore, ...]
    prompt_ids: tuple[int, ...] = ()
    reconstructions: dict[tuple[int, ...], list[torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )


@dataclass(frozen=True)
class _Reconstruction:
    """The kvzip pass being run: the repeat input of the chunk at positions
    ``[start, end)``, scored against the ``sink`` first keys, the chunk's
    and its own."""

    sink: int
    start: int
    end: int


def _cat(old: torch.Tensor | None, new: torch.Tensor, dim: int) -> torch.Tensor:
    return new if old is None else torch.cat([old, new], dim=dim)


def _live_in_position_order(
    positions: torch.Tensor, tensors: tuple[torch.Tensor, ...]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each head's ``tensors`` (``[H, S]`` or ``[H, S, D]``) reordered by
    position, padding last and cut to the longest head; and the live mask."""
    order = torch.sort(positions, dim=-1, stable=True).indices
    live = torch.gather(positions, 1, order) < PADDING_POSITION
    width = int(live.sum(-1).max())
    order, live = order[:, :width], live[:, :width]
    taken = [
        torch.gather(t, 1, order if t.dim() == 2 else order[..., None].expand(-1, -1, t.shape[-1]))
        for t in tensors
    ]
    return taken, live


class ReferenceEvictingDecoder:
    """Greedy decoding with chunked prefill and per-(layer, KV head) eviction.

    ``config=None`` disables eviction (full cache), which validates the custom
    attention path against stock transformers.
    """

    # Repeat tokens per block of kvzip's pass: its logits and probabilities
    # take ``2 · Hq · rows · (prompt + chunk input)`` fp32 at once (~28 MB for
    # 9 query heads, 64 rows and a 4k prompt; larger blocks ran slower on CPU).
    reconstruction_rows = 64

    def __init__(
        self,
        model_dir: str | Path,
        config: EvictionConfig | None,
        block_size: int = 32,
        chunk_size: int | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        from transformers import AttentionInterface, AutoModelForCausalLM

        # Prefill chunks end at the eviction points: the config's
        # prefill_interval when it sets one, else chunk_size (default 512,
        # vLLM's usual --max-num-batched-tokens on CPU).
        interval = config.prefill_interval if config is not None else None
        if chunk_size is not None and interval is not None and chunk_size != interval:
            raise ValueError(
                f"chunk_size {chunk_size} differs from the config's prefill_interval {interval}"
            )
        chunk_size = chunk_size or interval or 512
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.config = config
        self.block_size = block_size
        self.chunk_size = chunk_size
        # The config builds the schedule (budget, interval, prefill mode), so
        # the oracle cannot drift from what the plugin's two processes use.
        self.schedule: EvictionSchedule | None = (
            config.schedule(block_size, chunk_size) if config is not None else None
        )
        self.policy: EvictionPolicy | None = config.build_policy() if config is not None else None

        # One registered name per instance: the function is a bound method, so
        # several decoders (e.g. different configs in one test session) never
        # share a store.
        self._attn_name = f"kvevict_reference_{uuid.uuid4().hex}"
        AttentionInterface.register(self._attn_name, self._attention)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=dtype, attn_implementation=self._attn_name
        )
        self.model.eval()
        self.model_dir = str(model_dir)
        self.num_layers: int = self.model.config.num_hidden_layers

        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        eos = gen_eos if gen_eos is not None else self.model.config.eos_token_id
        self.eos_token_ids: set[int] = (
            set() if eos is None else ({eos} if isinstance(eos, int) else set(eos))
        )

        # The learned policy: the gates read each layer's attention input,
        # captured by a forward pre-hook on transformers' attention modules.
        self.gates = None
        self._pending_log_beta: dict[int, torch.Tensor] = {}
        if self.policy is not None and self.policy.needs_log_beta:
            from vllm_kvevict.policies.gate_checkpoints import gates_for_model

            hf = self.model.config
            self.gates = gates_for_model(
                getattr(self.policy, "gates", None), hf.hidden_size, hf.num_hidden_layers,
                hf.num_key_value_heads, str(model_dir),
            ).to(dtype).eval()
            for index, layer in enumerate(self.model.model.layers):
                layer.self_attn.register_forward_pre_hook(
                    self._capture_gate_input(index), with_kwargs=True
                )

        self._layers: list[_LayerStore] = []
        self._step: _Step | None = None
        self._whole_prompt_queries: int | None = None  # run_prompt: queries kept per layer
        self._reconstructing: _Reconstruction | None = None  # kvzip's pass
        self._repeat_prompt: Any = None  # kvzip's RepeatPrompt, from the model's tokenizer
        self._prompt_ids: list[int] = []
        self.retained_positions: list[torch.Tensor] = []
        self.processed_tokens: int = 0

    @property
    def rule(self) -> KeepRule:
        """The plugin's keep rule around this decoder's policy."""
        assert self.config is not None and self.policy is not None
        return KeepRule(
            self.policy, self.config.build_allocation(), self.config.sink_tokens,
            self.config.recent_window,
        )

    def _capture_gate_input(self, index: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            assert self.gates is not None
            self._pending_log_beta[index] = self.gates(index, hidden[0])  # [T, H]

        return hook

    # ------------------------------------------------------------------ decode

    @torch.inference_mode()
    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, stop_at_eos: bool = False
    ) -> list[int]:
        """Greedy token ids (``torch.argmax``: the lowest id wins a tie)."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        # A fresh store per request makes the decoder reusable across prompts.
        self._layers = [_LayerStore() for _ in range(self.num_layers)]
        self._prompt_ids = list(prompt_ids)
        self.retained_positions = []
        self.processed_tokens = 0
        if max_new_tokens <= 0:
            return []

        prompt_len = len(prompt_ids)
        n = 0
        logits: torch.Tensor | None = None
        while n < prompt_len:  # chunked prefill
            n_after = min(n + self.chunk_size, prompt_len)
            logits = self._run_step(prompt_ids[n:n_after], n, n_after, prompt_len)
            n = n_after
        assert logits is not None
        return self._decode([int(torch.argmax(logits))], prompt_len, max_new_tokens, stop_at_eos)

    def _decode(
        self, out: list[int], prompt_len: int, max_new_tokens: int, stop_at_eos: bool,
        start: int | None = None,
    ) -> list[int]:
        """Greedy decode steps after the prompt (or from position ``start``),
        ``out`` holding the first token."""
        n = prompt_len if start is None else start
        # The last sampled token is never fed back, as in a serving engine.
        while len(out) < max_new_tokens:
            if stop_at_eos and out[-1] in self.eos_token_ids:
                break
            logits = self._run_step([out[-1]], n, n + 1, prompt_len)
            n += 1
            out.append(int(torch.argmax(logits)))

        self.processed_tokens = n
        self.retained_positions = [
            store.positions.clone() for store in self._layers if store.positions is not None
        ]
        return out

    # ------------------------------------------- one prompt, many settings

    def use_config(self, config: EvictionConfig | None) -> None:
        """Decode with another eviction config (None: the full cache) on the
        same loaded model. The learned policy's gates are loaded at
        construction only, so a config that needs them is refused here."""
        policy = config.build_policy() if config is not None else None
        if policy is not None and policy.needs_log_beta and self.gates is None:
            raise ValueError(
                f"policy {config.policy!r} needs its gates: build the decoder with that config"
            )
        self.config = config
        self.policy = policy
        self.schedule = config.schedule(self.block_size, self.chunk_size) if config is not None else None

    @torch.inference_mode()
    def run_prompt(self, prompt_ids: list[int], keep_queries: int) -> PromptState:
        """The whole prompt in one causal pass on the full cache (no eviction),
        keeping every layer's keys and values and its last ``keep_queries``
        queries: what an ``end_of_prompt`` eviction reads, so several settings
        continue from one prefill (:meth:`continue_from`)."""
        if not prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        prompt_len = len(prompt_ids)
        self._layers = [_LayerStore() for _ in range(self.num_layers)]
        self._whole_prompt_queries = max(1, keep_queries)
        positions = torch.arange(prompt_len, dtype=torch.long, device=self.model.device)
        self._step = _Step(0, prompt_len, prompt_len, positions)
        try:
            output = self.model(
                input_ids=torch.tensor([prompt_ids], dtype=torch.long, device=self.model.device),
                position_ids=positions[None], use_cache=False, logits_to_keep=1,
            )
        finally:
            self._step = None
            self._whole_prompt_queries = None
        first = int(torch.argmax(output.logits[0, -1].float()))
        return PromptState(prompt_len, first, tuple(self._layers), tuple(prompt_ids))

    @torch.inference_mode()
    def continue_from(
        self, state: PromptState, config: EvictionConfig | None, max_new_tokens: int,
        stop_at_eos: bool = False, question_ids: Sequence[int] = (),
    ) -> list[int]:
        """Greedy tokens of ``config`` on the prompt of ``state``: its
        end-of-prompt eviction applied to every layer, then decoding (with
        decode-time evictions). The same tokens as :meth:`generate`, whose
        chunked prefill attends to the same full prompt before that eviction.

        ``question_ids``: the state holds only the context, evicted without
        the question (query-agnostic, as KVzip and DefensiveKV evaluate); the
        question is then read as the first decode steps are, its tokens
        written in pieces that end at the decode-time eviction points, and
        the answer follows."""
        self.use_config(config)
        if config is not None and not self.schedule.holds_whole_prompt(state.prompt_len):
            raise ValueError(
                f"continue_from needs an end-of-prompt eviction; prefill_mode {config.prefill_mode!r} "
                f"evicts within a {state.prompt_len}-token prompt (use generate)"
            )
        self._layers = [replace(store) for store in state.layers]
        if max_new_tokens <= 0:
            return []
        if config is not None:
            prompt_len = state.prompt_len
            step = _Step(0, prompt_len, prompt_len, torch.arange(prompt_len, dtype=torch.long))
            window = config.observation_window
            for index, store in enumerate(self._layers):
                module = self.model.model.layers[index].self_attn
                assert store.query_history is not None and store.query_positions is not None
                if self.policy.needs_queries and store.query_history.shape[1] < min(window, prompt_len):
                    raise ValueError(
                        f"run_prompt kept {store.query_history.shape[1]} queries; observation_window "
                        f"{window} needs them all (run_prompt(..., keep_queries={window}))"
                    )
                if not config.pools_layers:
                    self._evict(store, step, float(module.scaling), self._model_parts(module))
                self._trim_queries(store, prompt_len)
            if config.pools_layers:
                if self.policy.needs_reconstruction and self._evicts_at(step):
                    self._reconstruction_from(state)
                self._evict_global(step)
        if not question_ids:
            return self._decode([state.first_token], state.prompt_len, max_new_tokens, stop_at_eos)
        n, end = state.prompt_len, state.prompt_len + len(question_ids)
        while n < end:
            piece_end = end
            if self.schedule is not None:
                points = self.schedule.eviction_points_in_step(n, end, state.prompt_len)
                piece_end = points[0] if points else end
            logits = self._run_step(list(question_ids[n - state.prompt_len:piece_end - state.prompt_len]),
                                    n, piece_end, state.prompt_len)
            n = piece_end
        return self._decode([int(torch.argmax(logits))], state.prompt_len, max_new_tokens, stop_at_eos,
                            start=end)

    def _run_step(
        self, token_ids: list[int], n_before: int, n_after: int, prompt_len: int
    ) -> torch.Tensor:
        """Run positions ``[n_before, n_after)``; return the last position's logits."""
        device = self.model.device
        positions = torch.arange(n_before, n_after, dtype=torch.long, device=device)
        self._step = _Step(n_before, n_after, prompt_len, positions)
        try:
            output = self.model(
                input_ids=torch.tensor([token_ids], dtype=torch.long, device=device),
                position_ids=positions[None],
                use_cache=False,
                logits_to_keep=1,
            )
            if self.config is not None and self.config.pools_layers:
                step = self._step
                if (self.policy.needs_reconstruction and n_after == prompt_len
                        and self._evicts_at(step)):
                    self._reconstruct(self._prompt_ids)
                self._evict_global(step)
        finally:
            self._step = None
        return output.logits[0, -1].float()

    # --------------------------------------------------------------- attention

    def _attention(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        """Append this step's K/V, attend over the store, then evict.

        query ``[1, Hq, T, D]``, key/value ``[1, H, T, D]`` (post-RoPE, only
        this step's tokens because the model runs with ``use_cache=False``).
        Returns ``[1, T, Hq, D]`` as transformers expects.
        """
        step = self._step
        if step is None:
            raise RuntimeError("the reference attention only runs inside generate()")
        if query.shape[0] != 1:
            raise ValueError("the reference decoder runs one request (batch size 1)")
        scale = float(module.scaling if scaling is None else scaling)
        store = self._layers[module.layer_idx]
        if self._reconstructing is not None:
            return self._attend_reconstruction(query, key, value, store, scale), None

        q = query[0]  # [Hq, T, D]
        num_kv_heads = key.shape[1]
        step_pos = step.positions
        if self._whole_prompt_queries is not None:  # run_prompt: full cache, one causal pass
            keep = self._whole_prompt_queries
            store.keys, store.values = key[0], value[0]
            store.positions = step_pos[None].expand(num_kv_heads, -1)
            store.query_history, store.query_positions = q[:, -keep:], step_pos[-keep:]
            self._scale = scale
            out = torch.nn.functional.scaled_dot_product_attention(
                query.float(), key.float(), value.float(), is_causal=True, scale=scale,
                enable_gqa=True,
            )
            return out.transpose(1, 2).to(query.dtype), None
        store.keys = _cat(store.keys, key[0], dim=1)
        store.values = _cat(store.values, value[0], dim=1)
        store.positions = _cat(
            store.positions, step_pos[None].expand(num_kv_heads, -1), dim=1
        )
        store.query_history = _cat(store.query_history, q, dim=1)
        store.query_positions = _cat(store.query_positions, step_pos, dim=0)
        if self.gates is not None:
            log_beta = self._pending_log_beta.pop(module.layer_idx).float()  # [T, H]
            store.log_beta = _cat(store.log_beta, log_beta.T, dim=1)
        if store.reconstruction is not None:  # written after kvzip's pass: always kept
            written = torch.full((num_kv_heads, step_pos.numel()), float("inf"))
            store.reconstruction = _cat(store.reconstruction, written, dim=1)
        self._scale = scale

        if self.config is not None and self.config.moment_correction:
            out = self._attend_corrected(q, store, step_pos, scale)
        else:
            out = self._attend(q, store, step_pos, scale)

        if self.config is not None and not self.config.pools_layers:
            self._evict(store, step, scale, self._model_parts(module))
        if self.config is not None and self.policy is not None and self.policy.needs_queries:
            self._trim_queries(store, step.n_after)
        else:
            store.query_history = None  # no policy reads them
            store.query_positions = None
        return out.transpose(0, 1).unsqueeze(0).to(query.dtype), None

    def _trim_queries(self, store: _LayerStore, n_after: int) -> None:
        """Future eviction points are > n_after, so they only look at queries
        at positions >= n_after - observation_window. (With pooled layers the
        step's own point reads them after every layer ran, from the window
        before n_after, which this keeps.)"""
        assert self.config is not None and store.query_history is not None
        assert store.query_positions is not None
        keep_q = store.query_positions >= n_after - self.config.observation_window
        store.query_history = store.query_history[:, keep_q]
        store.query_positions = store.query_positions[keep_q]

    @staticmethod
    def _attend(
        q: torch.Tensor, store: _LayerStore, q_pos: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Causal-by-position GQA attention in fp32, ``[Hq, T, D]``."""
        assert store.keys is not None and store.values is not None and store.positions is not None
        num_q_heads = q.shape[0]
        num_kv_heads = store.keys.shape[0]
        group = num_q_heads // num_kv_heads
        # Query head j reads KV head j // group.
        k = store.keys.float().repeat_interleave(group, dim=0)  # [Hq, S, D]
        v = store.values.float().repeat_interleave(group, dim=0)
        kpos = store.positions.repeat_interleave(group, dim=0)  # [Hq, S]
        logits = torch.matmul(q.float(), k.transpose(1, 2)) * scale  # [Hq, T, S]
        future = kpos[:, None, :] > q_pos[None, :, None]
        logits = logits.masked_fill(future, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.matmul(probs, v)

    @staticmethod
    def _attend_corrected(
        q: torch.Tensor, store: _LayerStore, q_pos: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Attention plus MomentKV's closed-form contribution of each head's
        evicted tokens (Eqs. 9, 11, 12 of the paper, from raw sums in fp64)."""
        assert store.keys is not None and store.values is not None and store.positions is not None
        num_q_heads = q.shape[0]
        num_kv_heads = store.keys.shape[0]
        group = num_q_heads // num_kv_heads
        out = torch.empty(num_q_heads, q.shape[1], q.shape[2], dtype=torch.float64)
        for j in range(num_q_heads):
            h = j // group
            qj = q[j].double()  # [T, D]
            logits = qj @ store.keys[h].double().T * scale  # [T, S]
            future = store.positions[h][None, :] > q_pos[:, None]
            logits = logits.masked_fill(future, float("-inf"))
            weights = torch.exp(logits)  # unnormalised: Z_R = sum
            z_r = weights.sum(-1, keepdim=True)
            numerator = weights @ store.values[h].double()  # Z_R * f_R
            if store.moments is not None and store.moments[h][0]:
                n_e, k_bar, v_bar, s_tilde = store.moments[h]
                z_e = n_e * torch.exp(scale * (qj @ k_bar))[:, None]  # Jensen bound, Eq. 11
                c_q = cross_covariance_times(s_tilde, qj)  # full, diagonal or none
                f_e = v_bar[None, :] + scale * c_q / n_e  # Eq. 9
                numerator = numerator + z_e * f_e
                z_r = z_r + z_e
            out[j] = numerator / z_r
        return out.float()

    # ------------------------------------------- kvzip's reconstruction pass

    def _evicts_at(self, step: _Step) -> bool:
        """Whether ``step`` ends at an eviction point that moves the frontier."""
        assert self.schedule is not None
        reached = self._eviction_point(step)
        return reached is not None and reached[1] > self.schedule.frontier(step.n_before, step.prompt_len)

    def _reconstruction_from(self, state: PromptState) -> None:
        """kvzip's scores on the prompt of ``state`` into every layer's store
        (``self._layers``, copies of the state's full cache): computed once
        per state and (sink, recent window, chunk, anchor) settings."""
        assert self.config is not None
        policy = self.policy
        key = (self.config.sink_tokens, self.config.recent_window, policy.chunk_size, policy.anchor_tokens)
        if key not in state.reconstructions:
            if len(state.prompt_ids) != state.prompt_len:
                raise ValueError("kvzip repeats the prompt, and this PromptState holds no prompt ids")
            state.reconstructions[key] = self._reconstruct(list(state.prompt_ids))
        for store, scores in zip(self._layers, state.reconstructions[key], strict=True):
            store.reconstruction = scores

    @torch.inference_mode()
    def _reconstruct(self, prompt_ids: list[int]) -> list[torch.Tensor]:
        """KVzip's context reconstruction (:mod:`~vllm_kvevict.policies.kvzip`)
        on the full cache of the whole prompt that every layer's store holds:
        the model (without its LM head) runs each chunk's repeat input at the
        positions after the prompt, attending to the whole cache and itself;
        nothing it computes is stored but each layer's scores, Eq. (2), of
        the chunk's tokens, computed layer by layer inside the attention
        call. Sets and returns every layer's ``reconstruction [H, P]``
        (0 outside the chunks: the sinks and the recent window, which are
        kept anyway)."""
        from vllm_kvevict.policies.kvzip import RepeatPrompt, reconstruction_inputs

        assert self.config is not None and self.policy is not None
        prompt_len = len(prompt_ids)
        sink = min(self.config.sink_tokens, prompt_len)
        end = max(sink, prompt_len - self.config.recent_window)
        if self._repeat_prompt is None:
            from transformers import AutoTokenizer

            self._repeat_prompt = RepeatPrompt.from_tokenizer(AutoTokenizer.from_pretrained(self.model_dir))
        full = torch.arange(prompt_len)
        for store in self._layers:
            assert store.keys is not None and store.positions is not None
            if store.positions.shape[1] != prompt_len or not bool((store.positions == full).all()):
                raise AssertionError("kvzip's pass needs the whole prompt's cache in every head")
            store.reconstruction = torch.zeros(store.positions.shape, dtype=torch.float32)
        saved = self._step
        device = self.model.device
        try:
            for start, stop, input_ids in reconstruction_inputs(
                prompt_ids, sink, end, self._repeat_prompt, self.policy.chunk_size,
                self.policy.anchor_tokens,
            ):
                positions = torch.arange(prompt_len, prompt_len + len(input_ids), device=device)
                self._step = _Step(prompt_len, prompt_len + len(input_ids), prompt_len, positions)
                self._reconstructing = _Reconstruction(sink, start, stop)
                self.model.model(
                    input_ids=torch.tensor([input_ids], dtype=torch.long, device=device),
                    position_ids=positions[None], use_cache=False,
                )
        finally:
            self._step = saved
            self._reconstructing = None
        return [store.reconstruction for store in self._layers]

    def _attend_reconstruction(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, store: _LayerStore,
        scale: float,
    ) -> torch.Tensor:
        """One layer of a kvzip pass: the repeat input's attention over the
        whole cached prompt and itself (causal), returned as transformers
        expects (``[1, T, Hq, D]``), and the chunk's scores into the store,
        from the same probabilities, :attr:`reconstruction_rows` queries at
        a time in fp32. The store's keys and values stay as they were."""
        from vllm_kvevict.policies.kvzip import reconstruction_scores

        task = self._reconstructing
        assert task is not None and store.keys is not None and store.values is not None
        assert store.reconstruction is not None
        prompt_len, num_kv = store.keys.shape[1], store.keys.shape[0]
        _, num_q, num_in, dim = query.shape
        group = num_q // num_kv
        q = query[0].float().view(num_kv, group, num_in, dim)  # [H, G, n, D]
        keys_t = torch.cat([store.keys.to(q.device), key[0]], dim=1).float().transpose(1, 2)  # [H, D, P + n]
        values = torch.cat([store.values.to(q.device), value[0]], dim=1).float()  # [H, P + n, D]
        width = keys_t.shape[2]
        out = torch.empty_like(q)
        best = torch.zeros(num_kv, task.end - task.start, dtype=torch.float32, device=q.device)
        rows = self.reconstruction_rows
        for a in range(0, num_in, rows):
            b = min(a + rows, num_in)
            block = q[:, :, a:b].reshape(num_kv, group * (b - a), dim)
            logits = torch.bmm(block, keys_t).mul_(scale).view(num_kv, group, b - a, width)
            future = torch.arange(num_in, device=q.device)[None, :] > torch.arange(a, b, device=q.device)[:, None]
            logits[..., prompt_len:].masked_fill_(future, float("-inf"))
            probs = torch.softmax(logits, dim=-1)
            out[:, :, a:b] = torch.bmm(probs.view(num_kv, -1, width), values).view(num_kv, group, b - a, dim)
            best = torch.maximum(best, reconstruction_scores(
                probs[..., : task.sink], probs[..., task.start : task.end], probs[..., prompt_len:]
            ))
        store.reconstruction[:, task.start : task.end] = best.to(store.reconstruction.device)
        return out.view(num_q, num_in, dim).transpose(0, 1)[None].to(query.dtype)

    # ---------------------------------------------------------------- eviction

    def _model_parts(self, module: torch.nn.Module) -> dict[str, Any]:
        """The model parts the policy scores with, read from transformers'
        modules (independently of how the plugin finds them in vLLM)."""
        assert self.policy is not None
        parts: dict[str, Any] = {}
        if self.policy.needs_rotary:
            rotary = self.model.model.rotary_emb
            parts["rotary"] = RotaryFrequencies(
                rotary.inv_freq.double().cpu(), True, float(rotary.attention_scaling)
            )
        if self.policy.needs_output_projection:
            weight = module.o_proj.weight.detach()  # [d_model, Hq * D]
            num_q_heads = self.model.config.num_attention_heads
            parts["output_projection"] = weight.t().reshape(num_q_heads, -1, weight.shape[0])
        return parts

    def _eviction_point(self, step: _Step) -> tuple[int, int] | None:
        """(point, frontier after it) when ``step`` ends at an eviction point."""
        assert self.schedule is not None
        points = self.schedule.eviction_points_in_step(step.n_before, step.n_after, step.prompt_len)
        if not points:
            return None
        # This oracle cuts its steps at the eviction points (prefill chunks of
        # prefill_interval tokens, one token per decode step), so a step never
        # needs the in-pass eviction the plugin does for longer steps.
        if points != [step.n_after]:
            raise AssertionError(f"step {step} crosses eviction points {points}")
        return points[0], self.schedule.frontier_at_point(points[0], step.prompt_len)

    def _observation_queries(
        self, store: _LayerStore, point: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The stored queries of positions ``[point - observation_window,
        point)`` and their positions, or ``(None, None)`` for a policy that
        reads no queries."""
        assert self.config is not None and self.policy is not None
        if not self.policy.needs_queries:
            return None, None
        assert store.query_history is not None and store.query_positions is not None
        window = self.config.observation_window
        obs = (store.query_positions >= max(0, point - window)) & (store.query_positions < point)
        return store.query_history[:, obs], store.query_positions[obs]

    def _evict(
        self, store: _LayerStore, step: _Step, scale: float, parts: dict[str, Any]
    ) -> None:
        assert self.config is not None and self.schedule is not None and self.policy is not None
        assert store.keys is not None and store.values is not None and store.positions is not None
        assert store.query_history is not None and store.query_positions is not None
        reached = self._eviction_point(step)
        if reached is None:
            return
        point, frontier = reached
        # The protected prefix (prefix_caching shared) is kept whole and is
        # not a candidate: the policy scores the tokens after it.
        prefix = self.schedule.protected_prefix(step.prompt_len)
        if frontier <= self.schedule.frontier(step.n_before, step.prompt_len):
            return  # the frontier stays: every token is kept
        if self.config.uses_head_pages:
            self._evict_head_pages(store, point, prefix, frontier, scale, parts)
            return
        num_keep = point - frontier

        # Positions are sorted per head (appended in order, and kept indices
        # are sorted), and every head holds the same tokens >= point (this
        # step's) and the same prefix tokens, so the candidates are the same
        # slice [first, num_cand) of each head.
        cand_mask = store.positions < point
        num_cand = int(cand_mask[0].sum())
        if not bool(cand_mask[:, :num_cand].all()) or bool(cand_mask[:, num_cand:].any()):
            raise AssertionError("stored positions are not sorted per head")
        first = int((store.positions[0] < prefix).sum())
        if first != min(prefix, num_cand) or not bool((store.positions[:, :first] < prefix).all()):
            raise AssertionError("the protected prefix is not stored whole at the start of every head")
        if num_keep >= num_cand - first:
            return

        queries, query_positions = self._observation_queries(store, point)
        inputs = ScoringInputs(
            keys=store.keys[:, first:num_cand],
            values=store.values[:, first:num_cand],
            key_positions=store.positions[:, first:num_cand],
            queries=queries,
            query_positions=query_positions,
            scale=scale,
            **parts,
        )
        num_heads = store.keys.shape[0]
        # Every head keeps exactly num_keep tokens: a uniform split of one-token pages.
        _, kept = choose_kept(self.rule, [inputs], [None], point, num_heads * num_keep, 1)
        if kept.shape != (store.keys.shape[0], num_keep):
            raise AssertionError(f"policy returned {tuple(kept.shape)}, expected {num_keep} per head")

        def keep(t: torch.Tensor) -> torch.Tensor:
            idx = kept if t.dim() == 2 else kept[..., None].expand(-1, -1, t.shape[-1])
            return torch.cat([t[:, :first], torch.gather(t[:, first:num_cand], 1, idx), t[:, num_cand:]], dim=1)

        store.keys = keep(store.keys)
        store.values = keep(store.values)
        store.positions = keep(store.positions)

    def _evict_head_pages(
        self, store: _LayerStore, point: int, prefix: int, frontier: int, scale: float,
        parts: dict[str, Any],
    ) -> None:
        """head_pages storage: the layer keeps ``H * (point // bs - frontier // bs)``
        whole pages of tokens, split across heads by the allocation, after
        the protected prefix's ``prefix`` tokens, which every head keeps."""
        assert self.config is not None and self.policy is not None
        assert store.keys is not None and store.values is not None and store.positions is not None
        assert store.query_history is not None and store.query_positions is not None
        bs = self.block_size
        num_heads, _, head_dim = store.keys.shape
        # Steps end at the point, so every stored token after the prefix is a
        # candidate; the prefix's are the first ``prefix`` of every head in
        # position order.
        (keys, values, positions), live = _live_in_position_order(
            store.positions, (store.keys, store.values, store.positions)
        )
        if not bool((positions[:, :prefix] == torch.arange(prefix)).all()):
            raise AssertionError("the protected prefix is not stored whole in every head")
        kept_prefix = keys[:, :prefix], values[:, :prefix], positions[:, :prefix]
        keys, values, positions, live = keys[:, prefix:], values[:, prefix:], positions[:, prefix:], live[:, prefix:]
        queries, query_positions = self._observation_queries(store, point)
        moments = None
        if self.config.moment_correction:
            if store.moments is None:
                moments = EvictedMoments.zeros(
                    None, num_heads, head_dim, covariance=self.config.moment_covariance
                )
            else:
                moments = EvictedMoments(
                    torch.tensor([float(m[0]) for m in store.moments]),
                    torch.stack([m[1] for m in store.moments]).float(),
                    torch.stack([m[2] for m in store.moments]).float(),
                    torch.stack([m[3] for m in store.moments]).float(),
                )
        inputs = ScoringInputs(
            keys=keys, values=values, key_positions=positions,
            queries=queries,
            query_positions=query_positions,
            scale=scale,
            evicted=moments,
            **parts,
        )
        total_pages = num_heads * (point // bs - frontier // bs)
        counts, kept = choose_kept(self.rule, [inputs], [live], point, total_pages, bs)  # -1 padded
        if store.evicted_keys is None:
            store.evicted_keys = [torch.zeros(0, head_dim, dtype=torch.float64)] * num_heads
            store.evicted_values = [torch.zeros(0, head_dim, dtype=torch.float64)] * num_heads
        assert store.evicted_values is not None
        width = kept.shape[1]
        new_keys = keys.new_zeros(num_heads, width, head_dim)
        new_values = values.new_zeros(num_heads, width, head_dim)
        new_positions = torch.full((num_heads, width), PADDING_POSITION, dtype=torch.int64)
        for h, count in enumerate(counts.tolist()):
            index = kept[h, :count]
            new_keys[h, :count] = keys[h, index]
            new_values[h, :count] = values[h, index]
            new_positions[h, :count] = positions[h, index]
            evicted = live[h].clone()
            evicted[index] = False
            store.evicted_keys[h] = torch.cat([store.evicted_keys[h], keys[h, evicted].double()])
            store.evicted_values[h] = torch.cat([store.evicted_values[h], values[h, evicted].double()])
        store.keys = torch.cat([kept_prefix[0], new_keys], dim=1)
        store.values = torch.cat([kept_prefix[1], new_values], dim=1)
        store.positions = torch.cat([kept_prefix[2], new_positions], dim=1)
        store.moments = []
        for keys_e, values_e in zip(store.evicted_keys, store.evicted_values):
            n_e = keys_e.shape[0]
            s_k, s_v = keys_e.sum(0), values_e.sum(0)
            s_tilde = values_e.T @ keys_e - torch.outer(s_v, s_k) / max(n_e, 1)
            if self.config.moment_covariance == "diagonal":
                s_tilde = s_tilde.diagonal().clone()
            elif self.config.moment_covariance == "none":
                s_tilde = s_tilde.new_zeros(0)
            store.moments.append((n_e, s_k / max(n_e, 1), s_v / max(n_e, 1), s_tilde))

    def _evict_global(self, step: _Step) -> None:
        """head_budget global or pyramid, after every layer ran: the request
        keeps ``L * H * (point // bs - frontier // bs)`` whole pages of tokens,
        split over every (layer, KV head) by the allocation (DBTrimKV's global
        top-B, or PyramidKV's layer budgets)."""
        assert self.config is not None and self.schedule is not None and self.policy is not None
        reached = self._eviction_point(step)
        if reached is None:
            return
        point, frontier = reached
        if frontier <= self.schedule.frontier(step.n_before, step.prompt_len):
            return
        bs, stores = self.block_size, self._layers
        gathered, inputs, lives = [], [], []
        for index, store in enumerate(stores):
            assert store.keys is not None and store.values is not None and store.positions is not None
            if not self.policy.needs_log_beta:  # no gates: log β unused
                store.log_beta = torch.zeros(store.positions.shape, dtype=torch.float32)
            if not self.policy.needs_reconstruction:  # no kvzip pass: unused
                store.reconstruction = torch.zeros(store.positions.shape, dtype=torch.float32)
            elif store.reconstruction is None:
                # Raised here: the selection would keep sinks and recent tokens instead.
                raise RuntimeError("kvzip evicts with its reconstruction scores, and none were computed")
            taken, live = _live_in_position_order(
                store.positions,
                (store.keys, store.values, store.positions, store.log_beta, store.reconstruction),
            )
            queries, query_positions = self._observation_queries(store, point)
            inputs.append(ScoringInputs(
                keys=taken[0], values=taken[1], key_positions=taken[2], queries=queries,
                query_positions=query_positions, scale=self._scale, log_beta=taken[3], step=point,
                reconstruction=taken[4] if self.policy.needs_reconstruction else None,
                **self._model_parts(self.model.model.layers[index].self_attn),
            ))
            lives.append(live)
            gathered.append(taken)
        num_heads = stores[0].keys.shape[0]
        total_pages = len(stores) * num_heads * (point // bs - frontier // bs)
        counts, kept = choose_kept(self.rule, inputs, lives, point, total_pages, bs)
        for layer, (store, (keys, values, positions, log_beta, reconstruction)) in enumerate(
            zip(stores, gathered)
        ):
            rows = slice(layer * num_heads, (layer + 1) * num_heads)
            layer_counts, layer_kept = counts[rows], kept[rows]
            new_width = max(int(layer_counts.max()), 1)
            store.keys = keys.new_zeros(num_heads, new_width, keys.shape[-1])
            store.values = values.new_zeros(num_heads, new_width, values.shape[-1])
            store.positions = torch.full((num_heads, new_width), PADDING_POSITION, dtype=torch.int64)
            store.log_beta = torch.zeros(num_heads, new_width)
            store.reconstruction = (
                torch.zeros(num_heads, new_width) if self.policy.needs_reconstruction else None
            )
            for h, count in enumerate(layer_counts.tolist()):
                index = layer_kept[h, :count]
                store.keys[h, :count] = keys[h, index]
                store.values[h, :count] = values[h, index]
                store.positions[h, :count] = positions[h, index]
                store.log_beta[h, :count] = log_beta[h, index]
                if store.reconstruction is not None:
                    store.reconstruction[h, :count] = reconstruction[h, index]
