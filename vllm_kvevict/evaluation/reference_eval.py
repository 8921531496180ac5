"""`kvevict eval --engine reference`: the same RULER samples and scores, decoded
in this process by the reference decoder, one full-cache prefill per sample
shared by every setting that evicts at the end of the prompt.

With ``prefill_mode: end_of_prompt`` every setting attends to the same full
prompt before its eviction, so the prompt is run once
(:meth:`ReferenceEvictingDecoder.run_prompt`) and each setting evicts from
that state and decodes (:meth:`~ReferenceEvictingDecoder.continue_from`,
token for token what its own prefill gives: ``tests/test_reference_decoder.py``).
A policy study of ten settings then costs one prefill and ten short decodes
per sample instead of ten served prefills. KVzip (``kvzip``, scored by this
engine only) runs its reconstruction pass from the shared prefill's state,
once per sample for every kvzip setting with the same sinks, recent window
and chunking; its seconds count in the first such setting's. The other settings (``per_chunk``
eviction, the learned policy's gates) evict inside the prompt, so each runs
its own chunked prefill (:meth:`~ReferenceEvictingDecoder.generate`, chunks
of 512 tokens as the servers' ``--max-num-batched-tokens``) on a decoder of
its own. A query-agnostic setting (``snapkv+agnostic@0.2``) continues from
a second shared prefill, of the prompt's context only (the tokens before
the RULER question): it evicts there, then reads the question and answers
(:meth:`~ReferenceEvictingDecoder.continue_from` with ``question_ids``), as
KVzip and DefensiveKV evaluate. It is the decoder the plugin's greedy tokens are tested against, in
fp32; served scores can differ from it where fp32 rounding of a batched
server flips a near-tie.

Records go to the same ``samples.jsonl`` as served runs, with a signature
naming this engine, so tables, intervals, ``--compare`` and resuming work
alike.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

from vllm_kvevict.evaluation.records import RecordLog, SampleRecord, prompt_sha
from vllm_kvevict.evaluation.ruler import RulerSample
from vllm_kvevict.evaluation.settings import ServingSetting, eviction_config

ENGINE = "reference-fp32"


def reference_signature(eviction: dict[str, Any] | None) -> str:
    payload = {"engine": ENGINE, "eviction": eviction}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def check_settings(settings: list[ServingSetting]) -> None:
    """What this engine cannot run, refused before any prompt is built."""
    for setting in settings:
        if not setting.managed:
            raise ValueError(f"setting {setting.name}: --engine reference decodes in this process; "
                             "a running server (NAME=URL) needs --engine serve")
        if setting.query_agnostic and not shares_prompt(setting.config_at_any_budget()):
            raise ValueError(f"setting {setting.name}: a query-agnostic setting evicts once, at the "
                             "context's end, from its full cache; use prefill_mode end_of_prompt and a "
                             "policy without gates (drop +agnostic for per_chunk or learned)")


def shares_prompt(config: Any) -> bool:
    """Whether a setting continues from the shared full-cache prefill: it evicts
    once, at the end of the prompt, and needs nothing computed during the
    prompt but its keys, values and last queries (the learned policy's gates
    read every layer's input as the prompt runs; kvzip's pass runs after the
    prompt, from its full cache, so it shares it)."""
    if config is None:
        return True
    policy = config.build_policy()
    return config.prefill_mode == "end_of_prompt" and not policy.needs_log_beta


class ReferenceEvalRunner:
    """Scores every (setting, length, sample) with the reference decoder."""

    def __init__(self, out_dir: Path, tokenizer: Any, model_dir: str, *, max_new_tokens: int = 128,
                 progress: bool = True) -> None:
        self.out_dir = out_dir
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.max_new_tokens = max_new_tokens
        self.progress = progress
        out_dir.mkdir(parents=True, exist_ok=True)
        self.log = RecordLog(out_dir / "samples.jsonl")

    def run(self, settings: list[ServingSetting],
            samples_by_length: dict[int, list[RulerSample]]) -> list[SampleRecord]:
        from tqdm import tqdm

        from vllm_kvevict.config import build_config
        from vllm_kvevict.reference import ReferenceEvictingDecoder

        check_settings(settings)
        decoder = ReferenceEvictingDecoder(self.model_dir, None)
        for length, samples in samples_by_length.items():
            own: dict[str, Any] = {}  # setting name -> its own decoder, for this length's budget
            mean_prompt = sum(s.prompt_tokens for s in samples) / len(samples)
            plans = []
            for setting in settings:
                eviction = eviction_config(setting, mean_prompt, context=f"setting {setting.name} at {length} tokens")
                config = None if eviction is None else build_config(eviction)
                plans.append((setting, config, reference_signature(eviction),
                              None if eviction is None else eviction["budget"]))
                if not shares_prompt(config):
                    own[setting.name] = ReferenceEvictingDecoder(self.model_dir, config)
            window = max([c.observation_window for setting, c, _, _ in plans
                          if c is not None and setting.name not in own], default=1)
            bar = tqdm(total=len(samples), desc=f"reference @ {length}", unit="sample",
                       disable=not self.progress, dynamic_ncols=True)
            # Sample i of every task before sample i + 1 of any: a run cut short
            # leaves every task with samples.
            for sample in sorted(samples, key=lambda x: x.index):
                sha = prompt_sha(sample, self.max_new_tokens, 0)
                todo = [p for p in plans
                        if self.log.get((p[0].name, length, sample.task, sample.index), p[2], sha) is None]
                if todo:
                    self._score(decoder, own, sample, length, sha, window, todo)
                bar.update()
            bar.close()
        wanted = {(s.name, length, x.task, x.index)
                  for s in settings for length, xs in samples_by_length.items() for x in xs}
        return [r for key, r in self.log.records.items() if key in wanted]

    def _score(self, decoder: Any, own: dict[str, Any], sample: RulerSample, length: int, sha: str,
               window: int, plans: list[tuple[ServingSetting, Any, str, int | None]]) -> None:
        prompt_ids = self.tokenizer(sample.prompt)["input_ids"]
        shared = [p for p in plans if p[0].name not in own and not p[0].query_agnostic]
        state = decoder.run_prompt(prompt_ids, keep_queries=window) if shared else None
        context = question = None
        if any(p[0].query_agnostic for p in plans):
            split = sample.question_token(self.tokenizer)
            context = decoder.run_prompt(prompt_ids[:split], keep_queries=window)
            question = prompt_ids[split:]
        max_tokens = min(sample.tokens_to_generate, self.max_new_tokens)
        for setting, config, sig, budget in plans:
            start = time.perf_counter()
            if setting.name in own:
                tokens = own[setting.name].generate(prompt_ids, max_tokens, stop_at_eos=True)
            elif setting.query_agnostic:
                tokens = decoder.continue_from(context, config, max_tokens, stop_at_eos=True,
                                               question_ids=question)
            else:
                tokens = decoder.continue_from(state, config, max_tokens, stop_at_eos=True)
            seconds = time.perf_counter() - start
            if tokens and tokens[-1] in decoder.eos_token_ids:
                tokens = tokens[:-1]  # a server's text and token ids stop before EOS
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            self.log.add(SampleRecord(
                setting.name, sig, length, sample.task, sample.index, sample.prompt_tokens, text,
                sample.score(text), tokens, 0, 0.0, seconds, budget, sha, None, list(sample.answers),
            ))
