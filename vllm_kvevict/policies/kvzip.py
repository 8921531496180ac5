"""KVzip (Kim et al., 2025, "KVzip: Query-Agnostic KV Cache Compression with
Context Reconstruction", NeurIPS 2025): a KV pair is worth what the model
needs of it to repeat the context.

The model is asked to repeat the prompt, and the prompt is teacher-forced
as its answer, in chunks, on the full cache. Eq. (2): for layer ``l`` and KV
head ``h``, with ``A = softmax(q K̄ᵀ · scale)`` the attention of the ``G``
query heads of ``h`` and the ``n_in`` repeat tokens of a chunk,

    S_{l,h}[i] = max_{g ≤ G, t ≤ n_in} A_{l,h}[g, t, i]      for each cached pair i of the chunk.

The pass is the model's own (:mod:`vllm_kvevict.reference.hf_decoder` runs
it); this module holds what it is asked to repeat
(:class:`RepeatPrompt`, :func:`reconstruction_inputs`), the score
(:func:`reconstruction_scores`) and the policy, whose :meth:`KVzipPolicy.score`
reads the scores the pass left (``ScoringInputs.reconstruction``). Nothing
here knows vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_kvevict.policies.base import EvictionPolicy, ScoringInputs

# The original code's instructions (model/wrapper.py), with its trailing space
# before the spliced anchor ids.
REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with "


@dataclass(frozen=True)
class RepeatPrompt:
    """The token ids around each chunk: ``first + turn + chunk`` for the first
    chunk, ``next + anchor + turn + chunk`` for the others, ``anchor`` the
    last ids of the chunk before. ``turn`` closes the user's turn and opens
    the assistant's, from the tokenizer's chat template, so the chunk is
    teacher-forced as the model's answer."""

    first: tuple[int, ...]
    next: tuple[int, ...]
    turn: tuple[int, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> RepeatPrompt:
        """The chat template's turn change, found as kvpress finds it: a
        user message ending in a marker, rendered with the generation prompt,
        and what follows the marker. A tokenizer without a chat template
        takes ``"\\n"`` (kvpress's default)."""
        if getattr(tokenizer, "chat_template", None) is None:
            turn = "\n"
        else:
            marker = "\n" + "#" * 13
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "dummy context" + marker}],
                add_generation_prompt=True, tokenize=False, enable_thinking=False,
            )
            turn = text.split(marker)[-1]

        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls(encode(REPEAT_FIRST), encode(REPEAT_NEXT), encode(turn))


def reconstruction_inputs(
    prompt_ids: list[int], start: int, end: int, prompt: RepeatPrompt, chunk_size: int,
    anchor_tokens: int,
) -> list[tuple[int, int, list[int]]]:
    """The chunks of positions ``[start, end)`` of ``prompt_ids`` and each
    one's repeat input: ``(chunk start, chunk end, input ids)``, chunks of
    ``chunk_size`` tokens, the last one shorter."""
    chunks = []
    for a in range(start, end, chunk_size):
        b = min(a + chunk_size, end)
        if a == start:
            head = list(prompt.first)
        else:
            head = list(prompt.next) + list(prompt_ids[max(start, a - anchor_tokens) : a])
        chunks.append((a, b, head + list(prompt.turn) + list(prompt_ids[a:b])))
    return chunks


def reconstruction_scores(
    sink_probs: torch.Tensor, chunk_probs: torch.Tensor, own_probs: torch.Tensor
) -> torch.Tensor:
    """Eq. (2) on one layer for one chunk, ``[H, m]`` fp32: each chunk key's
    largest attention from the ``G`` query heads of its KV head and the
    repeat tokens, from the pass's own attention probabilities (fp32, the
    softmax over the whole cache and the input, causal):
    ``sink_probs [H, G, n, s]``, ``chunk_probs [H, G, n, m]``,
    ``own_probs [H, G, n, n']``, for ``n`` of the repeat tokens (the maximum
    over the others is taken by the caller, row block by row block).

    The softmax is the original code's local one (attention/score.py): over
    ``K̄ = [sink_keys, chunk_keys, own_keys]`` alone, the always-kept first
    keys, the chunk's and the repeat input's own, though the pass itself
    attends to the whole cache. It is the pass's probabilities renormalised
    over ``K̄`` (``p_i / Σ_{j∈K̄} p_j = exp(l_i) / Σ_{j∈K̄} exp(l_j)``), so no
    logit is exponentiated twice.
    """
    local = sink_probs.sum(-1) + chunk_probs.sum(-1) + own_probs.sum(-1)  # [H, G, n], > 0: own_probs holds the diagonal
    tiny = torch.finfo(chunk_probs.dtype).tiny
    return (chunk_probs / local.clamp(min=tiny)[..., None]).amax(dim=(1, 2))


@dataclass
class KVzipPolicy(EvictionPolicy):
    """KVzip: a token's score is the largest attention its KV pair receives
    while the model repeats the prompt (Eq. (2), :func:`reconstruction_scores`),
    one scale for every layer and KV head, so the request keeps the best
    ``budget × layers × KV heads`` over all of them (``head_budget: global``,
    the paper's §4.1 "top r% … across all attention heads").

    The scoring pass runs after the whole prompt, on its full cache
    (``prefill_mode: end_of_prompt``), in the reference decoder
    (:class:`~vllm_kvevict.reference.ReferenceEvictingDecoder`, ``kvevict
    eval --engine reference``); the served path does not run it and refuses
    the policy.

    Following the original code (snu-mllab/KVzip):

    - the instructions' wording (with the trailing space before the anchor),
      the last ``anchor_tokens`` (8) ids of the chunk before spliced in as
      ids, each chunk teacher-forced as the assistant's answer;
    - each pass attends to the whole cached prompt and itself and is not
      kept: every chunk's input sits at the positions after the prompt;
    - the local softmax over ``[first keys, chunk keys, own keys]``, with the
      model's own attention scale (kvpress hard-codes 1/√head_dim).

    Following kvpress (``KVzipPress``): chunks of ``chunk_size`` 2048
    tokens (the original: 2000), and the turn change taken from the
    tokenizer's chat template rather than written per model.

    Choices of this implementation:

    - what KVzip keeps whole: the system prompt (the original) or 4 sinks
      (kvpress). Here the config's ``sink_tokens`` first tokens are those
      keys (always kept, and the "system" part of the local softmax), and the
      prompt's last ``recent_window`` tokens (the question, in this
      project's prompts) are always kept as by every end-of-prompt policy;
      the chunks cover the tokens between them, the candidates;
    - the softmax and the scores in fp32 (the original: the model's dtype,
      bf16, which ties many scores);
    - exactly the budget is kept: the top ``budget × layers × KV heads`` of
      one ranking over every (layer, KV head, token), ties to the earlier
      entry (:func:`~vllm_kvevict.eviction.allocation.global_top_b`), where
      the original keeps ``score > threshold`` and evicts every tie at the
      threshold; with whole-page storage each (layer, KV head) then rounds
      its count to whole pages (largest remainder), as for every global
      policy here;
    - generated tokens are always kept (as in KVzip, which never evicts
      them): they score ``+inf``, so the schedule's decode-time evictions,
      which hold the request to its budget as for every policy here, drop
      the lowest-scored prompt tokens left.

    Options:
        chunk_size: prompt tokens repeated per pass.
        anchor_tokens: ids of the chunk before that start the next
            instruction.
    """

    name: ClassVar[str] = "kvzip"
    needs_reconstruction: ClassVar[bool] = True
    global_scores: ClassVar[bool] = True
    default_head_budget: ClassVar[str] = "global"
    default_prefill_mode: ClassVar[str] = "end_of_prompt"

    chunk_size: int = 2048
    anchor_tokens: int = 8

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ValueError(f"kvzip: chunk_size must be at least 1, not {self.chunk_size}")
        if self.anchor_tokens < 0:
            raise ValueError(f"kvzip: anchor_tokens must be >= 0, not {self.anchor_tokens}")

    def score(self, inputs: ScoringInputs) -> torch.Tensor:
        if inputs.reconstruction is None:
            raise ValueError("kvzip scores with the reconstruction pass's attention; none was given")
        return inputs.reconstruction.float()
