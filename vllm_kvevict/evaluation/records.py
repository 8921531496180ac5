"""``samples.jsonl``, the scored samples of ``kvevict eval``: one
:class:`SampleRecord` per (setting, length, task, sample), appended as each is
scored, read back to resume. Served runs (``ruler_eval.py``) and the
reference decoder (``reference_eval.py``) write the same records."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_kvevict.evaluation.ruler import RulerSample


@dataclass
class SampleRecord:
    """One scored completion; a line of samples.jsonl."""

    setting: str
    signature: str  # what the setting's server was; a record with another is stale
    length: int
    task: str
    index: int
    prompt_tokens: int
    prediction: str
    score: float
    token_ids: list[int] = field(default_factory=list)
    kl_positions: int = 0
    kl_sum: float = 0.0
    seconds: float = 0.0
    budget: int | None = None  # tokens per (layer, KV head); None: no eviction or unknown
    prompt_sha: str = ""  # the prompt and request it answers (another seed: another prompt)
    tokens_kept: float | None = None  # mean tokens a (layer, KV head) held, this server
    answers: list[str] = field(default_factory=list)  # the references the prediction is scored against

    @property
    def key(self) -> tuple[str, int, str, int]:
        return (self.setting, self.length, self.task, self.index)


def prompt_sha(sample: RulerSample, max_tokens: int, logprobs: int) -> str:
    text = json.dumps([sample.prompt, min(sample.tokens_to_generate, max_tokens), logprobs])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class RecordLog:
    """samples.jsonl: appended line by line (thread-safe), read back on resume."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.records: dict[tuple[str, int, str, int], SampleRecord] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    record = SampleRecord(**json.loads(line))
                    self.records[record.key] = record  # the last line of a key wins

    def get(self, key: tuple[str, int, str, int], signature: str, prompt_sha: str) -> SampleRecord | None:
        record = self.records.get(key)
        fresh = record is not None and record.signature == signature and record.prompt_sha == prompt_sha
        return record if fresh else None

    def add(self, record: SampleRecord) -> None:
        with self.lock:
            self.records[record.key] = record
            with self.path.open("a") as handle:
                handle.write(json.dumps(asdict(record)) + "\n")
